"""Nothing of an embedded cluster listens beyond loopback, and ``dashboard: false`` starts no
dashboard process: the listening TCP sockets of every process the test started (Ray's GCS, raylet,
agents, workers and routers, redis-server) are read from ``/proc``."""

from __future__ import annotations

import os

import pytest

from cluster.launcher import Cluster
from tests.cluster.sockets import dashboard_processes, descendants, listeners

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_embedded_cluster_listens_on_loopback_only(cluster: Cluster, client) -> None:
    assert client.generate("what listens where?", max_tokens=2).completion_tokens == 2
    mine = listeners(descendants(os.getpid()))
    commands = {entry.command for entry in mine}
    # the check sees Ray's own servers, not just ours
    assert {"gcs_server", "raylet", "redis-server"} <= commands, mine
    exposed = [entry for entry in mine if not entry.loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert cluster.ray_session.address.startswith("127.0.0.1:")


def test_dashboard_false_starts_no_dashboard_process(cluster: Cluster, client) -> None:
    assert cluster.cfg.dashboard is False
    assert cluster.ray_session.dashboard_url() is None
    pids = descendants(os.getpid())
    # Ray's own servers are there (the check sees them), its dashboard process is not
    assert {"gcs_server", "raylet"} <= {entry.command for entry in listeners(pids)}
    assert not dashboard_processes(pids)
    assert client.generate("still serving?", max_tokens=2).completion_tokens == 2
