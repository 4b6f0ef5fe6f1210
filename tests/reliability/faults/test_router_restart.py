"""A router's process is killed (SIGKILL): Ray restarts it on the same port.

A client keeps its channel: its open stream ends UNAVAILABLE, its next calls succeed once the
router is back (gRPC channels reconnect), and the dead incarnation's request is stopped on
the worker (the worker sees the router answer with a new incarnation id).
"""

from __future__ import annotations

import pytest

from benchmarks.chaos_faults import router_kill_recovery

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_killed_router_restarts_and_clients_reconnect(cluster) -> None:
    row = router_kill_recovery(cluster, "router-1")
    assert row["open_stream"][0] == "UNAVAILABLE", row
    assert row["restarted"] and row["same_endpoint"], row
    assert row["recovery_s"] is not None, "no call succeeded after the router was killed"
    assert row["orphans_freed"], "the dead router's stream kept running on its worker"
