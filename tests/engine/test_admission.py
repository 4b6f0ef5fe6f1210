"""A waiting request's prefix survives the requests admitted before it: claimed blocks are
evicted last, and cache-aware admission (``EngineConfig.cache_aware_admission``) admits the
requests whose prefix is cached first, within its starvation bound; priorities still win;
claims go on admit, abort and preempt; nothing leaks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.fakes import FakeExecutor
from tests.engine.helpers import assert_no_blocks_in_use, run_all
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.request import Request

P1 = list(range(10, 34))  # 6 full blocks of 4 (the fake model's vocabulary is 64)
P2 = list(range(34, 58))
P3 = list(range(58, 64)) + list(range(40, 58))


def make(num_blocks: int, **cfg) -> Engine:
    cfg.setdefault("max_model_len", 256)
    return Engine(FakeExecutor(num_blocks, 4), EngineConfig(block_size=4, **cfg))


def params(max_tokens: int = 1, priority: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, priority=priority)


def _request(engine: Engine, rid: str) -> Request:
    (req,) = [r for r in engine.scheduler.waiting if r.request_id == rid]
    return req


def _admissions(engine: Engine) -> list[str]:
    """Request ids in the order the scheduler admits them, from now on."""
    order: list[str] = []
    schedule = engine.scheduler.schedule

    def recording():  # noqa: ANN202
        out = schedule()
        order.extend(out.admitted)
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return order


def _warm(engine: Engine, *prefixes: list[int]) -> None:
    """Cache each prefix (oldest first), nothing left in use."""
    for p in prefixes:
        engine.add_request(p + [1], params())
        run_all(engine)


def test_a_claimed_prefix_outlives_an_older_unclaimed_one_when_a_request_ahead_needs_room() -> None:
    """Strict FCFS, one sequence at a time: X (uncached, 10 blocks with its output) runs
    ahead of Y (P1 + a question); X's blocks come out of P2, which no one waits for, not out
    of P1 (older), which Y was queued for."""
    engine = make(16, max_num_seqs=1)
    _warm(engine, P1, P2)  # 12 cached blocks, P1 the least recently used
    engine.add_request(P3 + [1, 2, 3, 4], params(max_tokens=12), request_id="x")
    engine.add_request(P1 + [5, 6], params(), request_id="y")
    y = _request(engine, "y")
    run_all(engine)
    assert y.num_cached_tokens == 24  # all of P1
    assert engine.kv.cached_run(engine.kv.expected_prefix(P2 + [1], y.ctx, ())[1]) == 0
    assert not engine.kv.claims
    assert_no_blocks_in_use(engine)


def _hits(cache_aware: bool, **cfg) -> tuple[list[str], dict[str, int | None]]:
    """P1, P2 cached (12 of 16 blocks); A needs P3 (6 new blocks), then B (P1) and C (P2)
    queue: admitted in FCFS order, A's prefill evicts P1 or P2 (all claimed)."""
    engine = make(16, max_num_seqs=1, cache_aware_admission=cache_aware, **cfg)
    _warm(engine, P1, P2)
    order = _admissions(engine)
    reqs = []
    for rid, p in (("a", P3), ("b", P1), ("c", P2)):
        engine.add_request(p + [7], params(max_tokens=2), request_id=rid)
        reqs.append(_request(engine, rid))
    run_all(engine)
    assert_no_blocks_in_use(engine)
    assert not engine.kv.claims
    return order, {r.request_id: r.num_cached_tokens for r in reqs}


def test_cache_aware_admission_runs_cached_prefixes_before_one_that_would_evict_them() -> None:
    order, hits = _hits(cache_aware=True)
    assert order == ["b", "c", "a"]
    assert hits == {"a": 0, "b": 24, "c": 24}
    order, hits = _hits(cache_aware=False)  # strict order: A evicts a prefix B or C needed
    assert order == ["a", "b", "c"]
    assert hits["a"] == 0 and hits["b"] + hits["c"] < 48


def test_a_request_is_overtaken_at_most_max_overtakes_times() -> None:
    order, hits = _hits(cache_aware=True, admission_max_overtakes=1)
    assert order == ["b", "a", "c"]  # passed once by B: nothing passes A after that
    assert hits["b"] == 24


def test_a_request_waiting_max_wait_s_is_not_overtaken() -> None:
    order, _ = _hits(cache_aware=True, admission_max_wait_s=0.0)
    assert order == ["a", "b", "c"]


def test_priorities_win_over_cached_prefixes() -> None:
    engine = make(16, max_num_seqs=1, policy="priority", cache_aware_admission=True)
    _warm(engine, P1, P2)
    order = _admissions(engine)
    engine.add_request(P1 + [7], params(priority=1), request_id="cached-low")
    engine.add_request(P3 + [7], params(priority=0), request_id="uncached-high")
    engine.add_request(P2 + [7], params(priority=1), request_id="cached-low-2")
    engine.add_request(P3[:8] + [7], params(priority=1), request_id="uncached-low")
    run_all(engine)
    assert order == ["uncached-high", "cached-low", "cached-low-2", "uncached-low"]
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize("cache_aware", [False, True])
def test_claims_go_on_admit_abort_and_preempt_and_nothing_leaks(cache_aware: bool) -> None:
    """Two requests share P1 and grow past the cache together (6 shared + 7 + 7 blocks of
    16): the later one is preempted and re-claims its prompt while it waits."""
    engine = make(16, max_num_seqs=2, cache_aware_admission=cache_aware)
    _warm(engine, P1)
    engine.add_request(P1 + [7], params(max_tokens=28), request_id="long")
    engine.add_request(P2 + [7], params(max_tokens=2), request_id="gone")
    engine.add_request(P1 + [8], params(max_tokens=28), request_id="sibling")
    assert sum(engine.kv.claims.values()) == 3 * 6
    engine.abort("gone")  # waiting: its claims go, the sibling's stay
    assert engine.kv.claims == engine.scheduler.waiting.claims
    assert sorted(engine.kv.claims.values()) == [2] * 6
    engine.step()  # both admitted: every claim went with them
    assert not engine.kv.claims
    preempted: list[str] = []
    while engine.has_unfinished_requests():
        engine.step()
        waiting = list(engine.scheduler.waiting)
        preempted += [r.request_id for r in waiting if r.request_id not in preempted]
        expected = sum(len(s.claim) for r in waiting for s in r.seqs)
        assert sum(engine.kv.claims.values()) == expected > 0 or not waiting
        engine.kv.check_invariants()
    assert preempted == ["sibling"]
    assert not engine.kv.claims
    assert_no_blocks_in_use(engine)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(0, 3),
    plan=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(0, 2)),
        min_size=2,
        max_size=14,
    ),
)
def test_property_no_request_is_passed_more_than_max_overtakes_times(
    k: int, plan: list[tuple[int, int, int]]
) -> None:
    """Requests of four prefixes (three fit the cache) arrive between steps; whatever the
    order, a request is admitted after at most ``k`` admissions of later arrivals in earlier
    steps, everything finishes, and no claim or block is left."""
    engine = make(24, max_num_seqs=4, cache_aware_admission=True, admission_max_overtakes=k)
    prefixes = [P1, P2, P3, list(range(2, 26))]
    steps: list[list[str]] = []
    schedule = engine.scheduler.schedule

    def recording():  # noqa: ANN202
        out = schedule()
        steps.append(list(out.admitted))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    arrival: dict[str, int] = {}
    for i, (prefix, max_tokens, gap) in enumerate(plan):
        rid = engine.add_request(prefixes[prefix] + [i % 60 + 2], params(max_tokens=max_tokens))
        arrival[rid] = i
        for _ in range(gap):
            engine.step()
    run_all(engine)
    admitted_at: dict[str, int] = {}
    for n, ids in enumerate(steps):
        for rid in ids:
            admitted_at.setdefault(rid, n)  # first admission (a preempted one comes back)
    assert set(admitted_at) == set(arrival)
    for rid, step in admitted_at.items():
        passed_by = sum(1 for o, s in admitted_at.items() if arrival[o] > arrival[rid] and s < step)
        assert passed_by <= k, (rid, passed_by, steps)
    assert not engine.kv.claims
    assert_no_blocks_in_use(engine)
