"""A worker frozen by SIGSTOP (alive to Ray, answering nothing) while it streams.

Its streams move to the other worker after the routers' stall timeout (migration: they end
OK, complete) instead of hanging until it thaws; requests sent meanwhile are served by the
other worker (retried there when they were placed on the frozen one); ClusterStatus answers
and lists it as stale; after SIGCONT it serves again and nothing is left on it.
"""

from __future__ import annotations

import pytest

from benchmarks.chaos_faults import frozen_worker_recovery
from tests.reliability.helpers import wait_idle

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_frozen_worker_streams_end_and_new_requests_go_elsewhere(cluster) -> None:
    row = frozen_worker_recovery(cluster, max_freeze_s=30.0)
    victim = row["victim"]
    assert row["ended_while_frozen"], row  # not held until SIGCONT
    for code, details, _ in row["victim_streams"]:
        assert code == "OK", (code, details)  # continued on the other worker
    assert all(code == "OK" for code, _, _ in row["other_streams"]), row
    assert row["short_requests"] and all(
        code == "OK" and worker != victim for worker, code, _ in row["short_requests"]
    ), row
    # listed, and not alive: stale (its status call timed out), or already marked dead by the
    # router whose streams on it stalled (which of the two comes first is a race)
    assert row["status_listed_victim"] and not row["status_victim_alive"], row
    assert row["back_s"] is not None, "the thawed worker did not become live again"
    assert wait_idle(cluster, 30), "a request or KV block was left on a worker"
