"""Local Rays for tests, in this process: loopback single-node mode (never another's
`ray start` head), no dashboard process, workers' logs kept out of the test's output.

* :func:`shared_ray`: the session's Ray, started on first use and joined by every in-process
  :class:`cluster.launcher.Cluster` of the session (a cluster started in a connected process
  uses that Ray and leaves it up; its actors live in a namespace of their own and are killed
  when it goes down). Starting Ray costs seconds per cluster on CI's two cores; started once,
  it costs them once.
* :func:`no_ray`: for tests of a cluster that owns its Ray (it must start and stop it).
"""

from __future__ import annotations

import logging
import os

import ray

from cluster.local_ray import leave_loopback_ray, use_loopback_ray
from cluster.ray_head import no_dashboard_process

_shared: list[bool] = []  # [True] while the session's shared Ray is the connected one


def shared_ray() -> None:
    """Connect the session's shared Ray (started as an embedded cluster starts its own), or
    keep it; the session's end (tests/conftest.py) stops it."""
    if _shared and ray.is_initialized():
        return
    assert not ray.is_initialized(), "another Ray is connected: use no_ray() first"
    use_loopback_ray()
    with no_dashboard_process():
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            namespace=f"kvcluster-tests-{os.getpid()}",
            include_dashboard=False,
            dashboard_host="127.0.0.1",
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    _shared.append(True)


def shared_ray_up() -> bool:
    return bool(_shared) and ray.is_initialized()


def named_actors() -> list[dict]:
    """Named actors on the connected Ray, every namespace (a cluster's workers and routers)."""
    return ray.util.list_named_actors(all_namespaces=True)


def no_ray() -> None:
    """Stop the shared Ray if it is up (its next user starts it again)."""
    if _shared:
        _shared.clear()
        ray.shutdown()
        leave_loopback_ray()
    assert not ray.is_initialized(), "a Ray other than the shared one is still connected"
