"""Placements decided together: the decide thread takes everything queued at once, reads
the index for a run of placements in one round trip and decides them in arrival order,
each seeing its predecessors (its own pending placements, the load it sent); the answers
reach the loop in one hand-off per batch. The decisions are the ones the requests would get
one by one."""

from __future__ import annotations

import asyncio
import threading

from router import PrefixSource, PrefixSourceUnavailable, Reason, Router, RouteRequest
from router.placement.config import RoutingConfig
from router.serving.deciding import DecideThread
from tests.router.harness import MiniCluster, load, tokens

AFFINITY = RoutingConfig(policy="prefix_affinity", seed=3)


def burst_cluster() -> MiniCluster:
    """Warm: two documents cached on their workers; the burst's events stay in flight."""
    cluster = MiniCluster(4, AFFINITY)
    cluster.place("doc-a", tokens(1, 640))
    cluster.place("doc-b", tokens(2, 640))
    cluster.deliver_events = False
    return cluster


def test_prepared_together_decides_as_one_by_one() -> None:
    prompts = [tokens(1 + i % 3, 640) + tokens(100 + i, 48) for i in range(12)]
    alone, together = burst_cluster(), burst_cluster()
    one_by_one = [alone.place(f"r{i}", p) for i, p in enumerate(prompts)]
    reqs = [RouteRequest(f"r{i}", p) for i, p in enumerate(prompts)]
    prepared = together.router.prepare([(r, together.loads()) for r in reqs])
    batched = []
    for r, ready in zip(reqs, prepared, strict=True):
        d = together.router.route(r, together.loads(), ready)
        batched.append(d)
        together.queue[d.worker_id] += len(r.token_ids) - d.cached_tokens_expected
    seen = [(d.worker_id, d.reason, d.cached_tokens_expected, d.keys) for d in one_by_one]
    assert [(d.worker_id, d.reason, d.cached_tokens_expected, d.keys) for d in batched] == seen
    assert {d.reason for d in batched} >= {Reason.PREFIX}  # the index and pending were read
    assert len({d.worker_id for d in batched}) > 1


class Counting(PrefixSource):
    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    def lookup(self, keys):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.fail:
            raise PrefixSourceUnavailable("connection refused")
        return {"w0": len(keys), "w1": 0}

    def lookup_many(self, prompts):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.fail:
            raise PrefixSourceUnavailable("connection refused")
        return [{"w0": (len(k), 0), "w1": (0, 0)} for k, _ in prompts]


def test_one_index_read_per_batch_and_a_failed_read_routes_each_by_load() -> None:
    loads = {"w0": load(0), "w1": load(0)}
    reqs = [RouteRequest(f"r{i}", tokens(i, 64)) for i in range(5)]
    src = Counting()
    router = Router(AFFINITY, src, block_size=16)
    ready = router.prepare([(r, loads) for r in reqs] + [(RouteRequest("x", [1]), {})])
    assert src.calls == 1
    assert [p.index for p in ready[:5]] == [{"w0": (4, 0), "w1": (0, 0)}] * 5
    assert isinstance(ready[5], Exception)  # no candidates: that request's error alone
    down = Counting(fail=True)
    router = Router(AFFINITY, down, block_size=16)
    ready = router.prepare([(r, loads) for r in reqs])
    assert down.calls == 1 and router.metrics.index_errors == 5
    decisions = [router.route(r, loads, p) for r, p in zip(reqs, ready, strict=True)]
    assert {d.reason for d in decisions} == {Reason.NO_INDEX}


def test_the_decide_thread_batches_in_order_and_undoes_a_dropped_placement() -> None:
    batches: list[list[int]] = []
    dropped: list[tuple[tuple, str]] = []
    gate = threading.Event()
    threads: set[str] = set()

    def place_batch(jobs):  # noqa: ANN001, ANN202
        threads.add(threading.current_thread().name)
        gate.wait(10)
        batches.append([j[0] for j in jobs])
        return [f"d{j[0]}" if j[0] != 3 else ValueError("bad 3") for j in jobs]

    async def main() -> list:
        decide = DecideThread(place_batch, lambda job, d: dropped.append((job, d)))
        first = decide.place(0)  # the thread takes it alone and waits on the gate
        await asyncio.sleep(0.05)
        rest = [decide.place(i) for i in range(1, 6)]
        settled: list[int] = []
        decide.call(settled.append, 1)  # after 1..5's placements, before 6's
        later = decide.place(6)
        rest[1].cancel()  # request 2 leaves while it is being decided
        gate.set()
        got = [await first]
        for f in [*rest, later]:
            try:
                got.append(await f)
            except asyncio.CancelledError:
                got.append("cancelled")
            except ValueError as exc:
                got.append(str(exc))
        decide.close()
        assert settled == [1]
        return got

    got = asyncio.run(main())
    assert got == ["d0", "d1", "cancelled", "bad 3", "d4", "d5", "d6"]
    assert batches == [[0], [1, 2, 3, 4, 5], [6]]  # the call split the queued run in two
    assert dropped == [((2,), "d2")]
    assert threads == {"route"}
