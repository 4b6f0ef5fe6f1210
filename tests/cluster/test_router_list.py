"""Every router's list of routers (``ClusterStatus.routers``) is kept current in every router
placement: with ``router.location: anywhere`` too, a router that Ray restarted learns it
again from the router keeper."""

from __future__ import annotations

import os
import time

import pytest
import ray

from cluster.client import KVClusterClient
from cluster.launcher import Cluster
from tests.cluster.conftest import cluster_config
from tests.embedded_ray import shared_ray

pytestmark = [pytest.mark.ray, pytest.mark.redis]

WAIT_S = 60.0  # generous: the machine may be busy


def listed(address: str) -> list[str] | None:
    """The routers ``address``'s router lists (None: it does not answer)."""
    try:
        with KVClusterClient(address, retries=0, discover=False) as client:
            return [r.grpc_address for r in client.status(timeout=5).routers]
    except Exception:  # noqa: BLE001 - restarting
        return None


def incarnation(router) -> str | None:  # noqa: ANN001
    """The router's incarnation id (random per start; None: not answering)."""
    try:
        return ray.get(router.incarnation.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - restarting
        return None


def test_a_restarted_router_lists_the_routers_again_with_location_anywhere() -> None:
    shared_ray()
    cfg = cluster_config(
        f"anywhere-{os.getpid()}",
        workers={"num_workers": 1},
        router={"location": "anywhere", "num_routers": 2},
    )
    with Cluster(cfg) as c:
        assert c.keeper is not None  # the one keeper of the routers and their list
        everyone = list(c.endpoints)
        assert len(everyone) == 2
        assert all(listed(a) == everyone for a in everyone)
        victim = c.routers["router-1"]
        first = ray.get(victim.incarnation.remote(), timeout=WAIT_S)
        ray.kill(victim, no_restart=False)  # its process dies; Ray restarts it, its list empty
        deadline = time.monotonic() + WAIT_S
        while incarnation(victim) in (first, None):  # the restarted router
            assert time.monotonic() < deadline, "router-1 not restarted"
            time.sleep(0.2)
        while listed(everyone[1]) != everyone:
            assert time.monotonic() < deadline, f"router-1 lists {listed(everyone[1])}"
            time.sleep(0.5)
