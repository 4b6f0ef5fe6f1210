"""One cluster for the fault tests: 2 workers, 2 routers, its own redis-server, tiny model.

Every test here leaves the cluster healthy (a killed worker restarted by Ray, Redis back,
a killed router started again), so the tests do not depend on their order.
"""

from __future__ import annotations

import os

import pytest

from cluster.client import KVClusterClient
from cluster.launcher import Cluster
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import shared_ray
from tests.reliability.helpers import wait_workers_alive

# 4 running sequences per worker: a burst queues requests that have produced no token yet
FAULTS_ENGINE = {**ENGINE, "max_num_seqs": 4, "max_waiting": 64}
# a frozen worker is given up on after 2 s of silence and a 2 s probe
LIVENESS = {"stream_stall_s": 2.0, "probe_timeout_s": 2.0, "status_timeout_s": 1.0}


@pytest.fixture(scope="package")
def cluster() -> Cluster:
    cfg = cluster_config(
        f"rel-faults-{os.getpid()}",
        router={"num_routers": 2, "liveness": LIVENESS},
        # a worker's restart budget (3 by default) counts over the cluster's life, and the
        # tests here kill whichever worker serves their first stream: unbounded, so that no
        # order of victims exhausts one worker's (routers restart without bound already)
        workers={"engine": FAULTS_ENGINE, "max_restarts": -1},
    )
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cfg) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> KVClusterClient:
    with KVClusterClient(cluster.endpoints[0]) as c:
        yield c


@pytest.fixture(autouse=True)
def _workers_live_first(cluster: Cluster) -> None:
    """Each test starts with every worker live (a restart from the test before may still be
    under way): a test's failure is then its own, not its predecessor's."""
    wait_workers_alive(cluster)
