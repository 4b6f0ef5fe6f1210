"""A Ray of a test module's own, in this process: loopback single-node mode (never another's
`ray start` head), no dashboard, workers' logs kept out of the test's output."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from cluster.launcher import leave_loopback_ray, use_loopback_ray


@contextmanager
def embedded_ray(num_cpus: int, namespace: str) -> Iterator[None]:
    use_loopback_ray()
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus,
        namespace=f"{namespace}-{os.getpid()}",
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        leave_loopback_ray()
