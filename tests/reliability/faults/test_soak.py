"""Soak: a long mixed load of streams, unary calls, cancels, disconnects, tight deadlines and
malformed requests (see ``benchmarks.chaos_load.MixedLoad``) leaves nothing behind.

Every request ends with a code its kind allows, none hangs, no KV block stays referenced
and no request stays queued on any worker, and worker memory stays within
``RSS_MARGIN`` of what it was after warm-up. CI runs the small size; set
``KVCLUSTER_SOAK_FULL=1`` for the several-thousand-request size (``benchmarks/chaos.py``
runs it too, with faults injected).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from benchmarks.chaos import run_chaos
from tests.reliability.helpers import MixedLoad, wait_idle, worker_rss

pytestmark = [pytest.mark.ray, pytest.mark.redis]

RSS_MARGIN = (1.10, 32 << 20)  # end RSS <= warm-up RSS * 1.10 + 32 MiB, per worker
FULL = pytest.mark.skipif(
    not os.environ.get("KVCLUSTER_SOAK_FULL"),
    reason="several thousand requests: set KVCLUSTER_SOAK_FULL=1",
)


@pytest.mark.parametrize("requests", [200, pytest.param(3000, marks=FULL)])
def test_soak_leaves_no_block_no_request_no_memory_growth(cluster, requests) -> None:
    load = MixedLoad(cluster.endpoints, seed=requests)
    try:
        load.run(60, start=requests)  # warm-up (allocator pools, caches, compiled paths)
        assert wait_idle(cluster)
        warm = worker_rss(cluster)
        result = load.run(requests)
    finally:
        load.close()
    kinds = Counter(o.kind for o in result.outcomes)
    assert result.hung == 0
    assert len(result.outcomes) == requests
    assert not result.unexpected(), result.unexpected()[:5]
    assert all(
        kinds[k] > 0 for k in ("stream", "unary", "cancel", "disconnect", "deadline", "bad")
    ), kinds
    assert wait_idle(cluster), "a block or a request was left on a worker"
    end = worker_rss(cluster)
    factor, extra = RSS_MARGIN
    for w, before in warm.items():
        assert end[w] <= before * factor + extra, (w, before >> 20, end[w] >> 20)


def test_chaos_run_with_worker_kill_and_redis_restart(cluster) -> None:
    """The chaos benchmark's run, small: a worker is killed at 1/3, Redis restarted at 2/3."""
    report = run_chaos(cluster, 90, seed=3, warmup=10, log=lambda _: None)
    assert report.hung == 0 and report.stuck == 0 and report.blocks_leaked == 0, report
    assert report.unexpected == 0, report
    assert report.completed > 0 and report.sent == 90
    assert report.completed + sum(report.failed.values()) == report.sent
