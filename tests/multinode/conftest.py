"""One 3-node Ray for the package: Ray's multi-node test cluster (three raylets on this
machine, each its own object store, all on 127.0.0.1), and a kvcluster on it (3 workers,
a router on every node). A node is removed as a node dies (its raylet and every process on
it killed, no graceful shutdown) and added back as a new node."""

from __future__ import annotations

import logging
import os

import pytest
import ray
from ray.cluster_utils import Cluster as RayNodes

from cluster.launcher import Cluster
from cluster.local_ray import leave_loopback_ray, use_loopback_ray
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import no_ray

NODE_CPUS = 2
WAIT_NODES_S = 180.0  # three raylets starting on a busy 2-core machine


@pytest.fixture(scope="package")
def ray_nodes() -> RayNodes:
    no_ray()  # the session's shared single-node Ray, if up, is not this one
    use_loopback_ray()
    nodes = RayNodes(
        initialize_head=True,
        head_node_args={
            "num_cpus": NODE_CPUS,
            "include_dashboard": False,
            # a node that stops answering is dead to Ray after ~3 s (default ~30 s)
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    for _ in range(2):
        nodes.add_node(num_cpus=NODE_CPUS)
    ray.init(
        address=nodes.address,
        namespace=f"kvcluster-multinode-{os.getpid()}",
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    nodes.wait_for_nodes(timeout=WAIT_NODES_S)
    yield nodes
    ray.shutdown()
    nodes.shutdown()
    leave_loopback_ray()


@pytest.fixture(scope="package")
def cluster(ray_nodes: RayNodes) -> Cluster:
    cfg = cluster_config(
        f"multinode-{os.getpid()}",
        workers={"num_workers": 3, "engine": {**ENGINE, "max_num_seqs": 4}},
        router={"liveness": {"stream_stall_s": 2.0, "probe_timeout_s": 2.0}},
    )
    with Cluster(cfg) as c:
        yield c
