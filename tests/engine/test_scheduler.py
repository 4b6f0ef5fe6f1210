"""Scheduler and step loop on a fake model with a real paged KV cache (exact and fast)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tests.engine.fakes import FakeExecutor, reference_generate
from tests.engine.helpers import assert_no_blocks_in_use, run_all
from worker.engine import (
    Engine,
    EngineConfig,
    EngineOverloaded,
    FinishReason,
    InvalidRequest,
    SamplingParams,
)
from worker.engine.preemption import pick_victim, should_swap
from worker.engine.request import Request
from worker.status import worker_load, worker_status

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def make(num_blocks: int = 256, block_size: int = 4, **cfg) -> tuple[Engine, FakeExecutor]:
    ex = FakeExecutor(num_blocks, block_size)
    cfg.setdefault("max_model_len", 256)
    return Engine(ex, EngineConfig(block_size=block_size, **cfg)), ex


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 64) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check_against_reference(engine, ps, params=GREEDY) -> None:
    ids = [engine.add_request(p, params) for p in ps]
    results = run_all(engine)
    for rid, p in zip(ids, ps, strict=True):
        got = results[rid].completions[0].token_ids
        assert got == reference_generate(p, params.max_tokens), rid
    assert_no_blocks_in_use(engine)


def test_batch_matches_reference() -> None:
    engine, ex = make()
    check_against_reference(engine, prompts(8, 3, 40))
    assert engine.metrics().num_preemptions == 0


def test_tiny_pool_preempts_and_chunks_yet_outputs_are_exact() -> None:
    engine, ex = make(
        num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=8
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ps = prompts(8, 6, 30, seed=1)
    ids = [engine.add_request(p, params) for p in ps]
    results = run_all(engine)
    for rid, p in zip(ids, ps, strict=True):
        assert results[rid].completions[0].token_ids == reference_generate(p, 20, ignore_eos=True)
    m = engine.metrics()
    assert m.num_preemptions > 0 and m.num_partial_prefills > 0, m
    for batch in ex.batches:  # the token budget and the per-request prefill cap hold
        assert sum(n for _, n, _ in batch) <= 16
        assert all(n <= 8 for _, n, _ in batch)
    assert_no_blocks_in_use(engine)


def test_queued_prefill_counts_only_the_uncached_part_of_waiting_prompts() -> None:
    """The load a worker reports (what a router weighs against recomputing elsewhere) is the
    prefill it will really do: a waiting prompt whose prefix is cached counts only the rest."""
    engine, _ = make(max_num_batched_tokens=64, max_num_seqs=1)
    prefix = list(range(30, 54))  # 6 full blocks of 4
    engine.add_request(prefix + [7, 8], SamplingParams(temperature=0, max_tokens=1))
    run_all(engine)  # the prefix is cached now, nothing in use
    engine.add_request(list(range(2, 12)), SamplingParams(temperature=0, max_tokens=50))
    engine.step()  # occupies the only sequence slot: the next requests wait
    engine.add_request(prefix + [9, 10, 11], GREEDY)  # 24 cached of 27
    engine.add_request(list(range(2, 15))[::-1], GREEDY)  # 13, nothing cached
    assert len(engine.scheduler.waiting) == 2
    assert engine.metrics().queued_prefill_tokens == (27 - 24) + 13
    run_all(engine)
    assert_no_blocks_in_use(engine)


def test_queued_prefill_counts_a_shared_prefix_once_per_burst() -> None:
    """Siblings queued together behind one that will compute their shared prefix count only
    their tails (the engine computes the prefix once); an abort of the one ahead recounts."""
    engine, _ = make(max_num_batched_tokens=64, max_num_seqs=1)
    engine.add_request(list(range(2, 12)), SamplingParams(temperature=0, max_tokens=50))
    engine.step()  # occupies the only sequence slot: the next requests wait
    prefix = list(range(30, 54))  # 6 full blocks of 4, cached nowhere yet
    first = engine.add_request(prefix + [7, 8], GREEDY)
    engine.add_request(prefix + [9, 10, 11], GREEDY)
    engine.add_request(prefix[:8] + [5, 6, 7, 8, 9], GREEDY)  # shares 2 blocks of it
    assert engine.metrics().queued_prefill_tokens == 26 + (27 - 24) + (13 - 8)
    engine.abort(first)  # the second now computes the prefix, the third still shares 2
    assert engine.metrics().queued_prefill_tokens == 27 + (13 - 8)
    assert sum(engine.scheduler.waiting.claims.values()) == 6 + 3  # the aborted one's claims went
    results = run_all(engine)
    assert all(r.completions[0].token_ids for rid, r in results.items() if rid != first)
    assert engine.metrics().queued_prefill_tokens == 0
    assert not engine.scheduler.waiting.claims  # every claim went with its request
    assert_no_blocks_in_use(engine)


def test_load_reports_the_cached_blocks_waiting_prefixes_will_pin_each_once() -> None:
    """Two waiting requests share a cached 6-block prefix, a third hits a cached 3-block
    one, a fourth nothing: the evictable blocks they will pin are 6 + 3, the shared prefix
    once, less the 2 the running request holds already (not free: not counted twice)."""
    engine, _ = make(max_num_batched_tokens=64, max_num_seqs=1)
    prefix, other = list(range(30, 54)), list(range(52, 64))  # 6 and 3 full blocks of 4
    engine.add_request(prefix + [7, 8], SamplingParams(temperature=0, max_tokens=1))
    engine.add_request(other + [7], SamplingParams(temperature=0, max_tokens=1))
    run_all(engine)  # both prefixes cached, nothing in use
    assert engine.snapshot().waiting_pinned_blocks == 0
    engine.add_request(
        prefix[:8] + list(range(2, 12)), SamplingParams(temperature=0, max_tokens=50)
    )
    engine.step()  # runs, holding the prefix's first 2 blocks; the rest wait
    engine.add_request(prefix + [9, 10, 11], GREEDY)
    engine.add_request(prefix + [3, 4, 5, 6], GREEDY)
    engine.add_request(other + [5], GREEDY)
    engine.add_request(list(range(2, 15))[::-1], GREEDY)
    assert len(engine.scheduler.waiting) == 4
    snap = engine.snapshot()
    assert snap.waiting_pinned_blocks == 4 + 3
    assert worker_load(snap).waiting_pinned_blocks == 7
    assert worker_status("w", snap, epoch=1, index_healthy=True).waiting_pinned_blocks == 7
    # a pull landed for a waiting request is the advising router's to count (its ledger)
    (seq,) = [r.seqs[0] for r in engine.scheduler.waiting if r.seqs[0].token_ids == other + [5]]
    engine.kv.pool.order.mark_landed(engine.kv.pool.cached[k] for k in seq.claim)
    assert engine.snapshot().waiting_pinned_blocks == 4
    run_all(engine)
    assert engine.snapshot().waiting_pinned_blocks == 0
    assert_no_blocks_in_use(engine)


def test_decodes_first_then_prefill_chunks() -> None:
    engine, ex = make(max_num_batched_tokens=12, long_prefill_token_threshold=5, max_num_seqs=8)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(list(range(2, 6)), short)
    engine.step()  # prefill of the short request
    engine.add_request(list(range(30, 50)), GREEDY)  # 20-token prompt: chunks of 5
    assert engine.metrics().queued_prefill_tokens == 20
    engine.step()
    assert engine.metrics().queued_prefill_tokens == 15
    engine.step()
    # decode (start 4 then 5) first, then a 5-token chunk of the long prompt, no logits
    assert ex.batches[1] == [(4, 1, True), (0, 5, False)]
    assert ex.batches[2] == [(5, 1, True), (5, 5, False)]
    run_all(engine)
    assert_no_blocks_in_use(engine)


def _three_growing(policy: str, priorities: tuple[int, int, int]) -> dict[str, int]:
    # 6 blocks of 4: three 4-token prompts fill 2 blocks each after the first decodes; the
    # 9th token needs a third block each, so one request must be preempted. With 8 new
    # tokens at most 11 tokens are ever computed: 3 blocks, so only one preemption is needed.
    engine, _ = make(num_blocks=6, policy=policy, admission_watermark=0.0)
    ids = {}
    for name, prio, p in zip("abc", priorities, prompts(3, 4, 4, seed=2), strict=True):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, priority=prio)
        ids[name] = engine.add_request(p, params, request_id=name)
    preempted = {}
    while engine.has_unfinished_requests():
        for name in ids:
            req = engine.requests.get(name)
            if req is not None:
                preempted[name] = req.num_preemptions
        engine.step()
    assert_no_blocks_in_use(engine)
    return preempted


def test_fcfs_preempts_latest_arrival() -> None:
    assert _three_growing("fcfs", (0, 0, 0)) == {"a": 0, "b": 0, "c": 1}


def test_priority_preempts_lowest_priority() -> None:
    # smaller value = more important: "a" (2) is the least important although it came first
    assert _three_growing("priority", (2, 1, 0)) == {"a": 1, "b": 0, "c": 0}


def test_resumed_request_is_protected_from_preemption() -> None:
    engine, _ = make(num_blocks=64)
    for name in "abc":
        engine.add_request([5, 6, 7, 8], GREEDY, request_id=name)
    sched = engine.scheduler
    sched.schedule()  # admit all three
    a, b, c = (engine.requests[n] for n in "abc")

    def victim(req: Request) -> Request | None:  # in a later step: none got blocks in it yet
        return pick_victim(req, sched.running, set(), sched.policy.key)

    assert victim(a) is c  # latest arrival, not protected
    c.protected = True  # c was just resumed
    assert victim(a) is b
    b.protected = True
    assert victim(a) is a  # everyone worse is protected: a itself waits
    c.protected = b.protected = False
    a.protected = True  # a protected request takes from the worst unprotected one
    assert victim(a) is c


def test_swap_or_recompute_estimate() -> None:
    def req(*computed: int) -> SimpleNamespace:  # sequences with that many tokens computed
        return SimpleNamespace(
            seqs=[SimpleNamespace(num_computed=n, allocated=True) for n in computed]
        )

    def swap(r: SimpleNamespace, mode: str = "auto", host: bool = True, cost: float = 1.0) -> bool:
        return should_swap(r, mode=mode, has_host_tier=host, block_size=16, block_cost=cost)

    assert not swap(req(40), "swap", host=False)  # without a host tier: always recompute
    assert not swap(req(40), "recompute") and swap(req(0), "swap")
    assert swap(req(40), cost=19.0)  # 2 full blocks x 19 = 38 < 40 tokens
    assert not swap(req(40), cost=20.0)  # 40 is not cheaper than 40
    assert swap(req(24, 16), cost=19.0) and not swap(req(24, 16), cost=20.0)  # 40 tokens in all
    assert not swap(req(0))  # nothing computed: nothing to keep


def test_prefix_hit_computes_fewer_tokens_same_output() -> None:
    engine, _ = make()
    shared = prompts(1, 40, 40, seed=3)[0]
    first = engine.generate([shared + [7, 8]], GREEDY)[0]
    before = engine.metrics().computed_tokens
    second = engine.generate([shared + [9, 10, 11]], GREEDY)[0]
    computed = engine.metrics().computed_tokens - before
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 40  # 10 full blocks of 4
    assert computed == 3 + len(second.completions[0].token_ids) - 1
    assert second.completions[0].token_ids == reference_generate(shared + [9, 10, 11], 12)
    assert_no_blocks_in_use(engine)


def test_burst_sharing_a_prompt_computes_it_once() -> None:
    # Three requests with one long prompt arrive together. The first is prefilled; the others
    # would hit its blocks while this very step writes them (FakeExecutor asserts that never
    # happens), so they wait one step and then get the whole prefix from the cache.
    engine, ex = make()
    p = prompts(1, 24, 24, seed=4)[0]
    check_against_reference(engine, [p, p, p + [3]])
    assert ex.batches[0] == [(0, 24, True)]
    assert ex.batches[1] == [(24, 1, True), (20, 4, True), (24, 1, True)]


def test_salted_requests_do_not_share_cache() -> None:
    engine, _ = make()
    p = prompts(1, 20, 20, seed=5)[0]
    engine.generate([p], SamplingParams(temperature=0, max_tokens=2, cache_salt="t1"))
    other = engine.generate([p], SamplingParams(temperature=0, max_tokens=2, cache_salt="t2"))
    same = engine.generate([p], SamplingParams(temperature=0, max_tokens=2, cache_salt="t1"))
    assert other[0].usage.cached_tokens == 0
    assert same[0].usage.cached_tokens == 16


def test_parallel_samples_fork_the_prompt_blocks() -> None:
    engine, _ = make(num_blocks=64)
    p = list(range(2, 12))  # 10 tokens: 2 full blocks + 1 partial block of 4
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    engine.add_request(p, params)
    engine.step()  # one prefill, then fork: the 4 samples share all 3 prompt blocks
    assert engine.kv.stats().used_blocks == 3
    engine.step()  # each sample writes into the shared partial block: 3 copy-on-writes
    assert engine.kv.stats().used_blocks == 2 + 4
    results = run_all(engine)
    comps = next(iter(results.values())).completions
    assert [c.index for c in comps] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in comps}) > 1
    assert_no_blocks_in_use(engine)


def test_abort_frees_every_block_of_a_request_and_its_forks() -> None:
    engine, _ = make(num_blocks=64)
    ids = [
        engine.add_request(p, SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
        for p in prompts(3, 5, 20, seed=6)
    ]
    waiting = engine.add_request([3, 4, 5], GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.kv.stats().used_blocks > 0
    for rid in [*ids, waiting]:
        assert engine.abort(rid)
    assert not engine.abort("nope")
    outs = engine.step()
    assert_no_blocks_in_use(engine)
    finished = {o.request_id for o in outs if o.finished}
    assert finished == {*ids, waiting}
    for o in outs:
        assert all(d.finish_reason is FinishReason.ABORT for d in o.outputs)
    assert not engine.has_unfinished_requests()


def test_overload_and_invalid_requests_are_typed_errors() -> None:
    engine, _ = make(num_blocks=8, max_waiting=2, max_num_seqs=4, max_model_len=64)
    engine.add_request([2, 3], GREEDY)
    engine.add_request([2, 3], GREEDY)
    with pytest.raises(EngineOverloaded) as exc:
        engine.add_request([2, 3], GREEDY)
    assert exc.value.max_waiting == 2
    with pytest.raises(InvalidRequest) as bad:
        engine.add_request(list(range(2, 40)), GREEDY)  # 38 tokens: 10 blocks > 8
    assert bad.value.field == "prompt" and bad.value.value == 38
    assert "8 blocks" in str(bad.value)
    engine2, _ = make(num_blocks=64, max_model_len=32, max_num_seqs=4)
    with pytest.raises(InvalidRequest, match="max_model_len=32") as bad:
        engine2.add_request([2] * 32, GREEDY)
    assert bad.value.field == "prompt"
    with pytest.raises(InvalidRequest) as bad:
        engine2.add_request([2, 3], SamplingParams(n=5))
    assert (bad.value.field, bad.value.value) == ("n", 5)
    with pytest.raises(InvalidRequest) as bad:
        engine2.add_request([2, 999], GREEDY)
    assert bad.value.field == "prompt"
    assert engine2.kv.stats().used_blocks == 0 and not engine2.requests


def test_model_failure_aborts_running_and_leaves_no_blocks() -> None:
    engine, ex = make()
    ids = [engine.add_request(p, GREEDY) for p in prompts(3, 10, 20, seed=7)]
    engine.step()
    ex.fail_next = True
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished and o.error} == set(ids)
    assert_no_blocks_in_use(engine)
    check_against_reference(engine, prompts(2, 10, 20, seed=8))  # the engine still works


def test_request_too_big_for_the_cache_alone_ends_with_length() -> None:
    # 4 samples of a 10-token prompt growing to 10 + 30 tokens cannot all fit 12 blocks.
    engine, _ = make(num_blocks=12, admission_watermark=0.0)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=30, ignore_eos=True, seed=0)
    engine.add_request(list(range(2, 12)), params)
    result = next(iter(run_all(engine).values()))
    assert {c.finish_reason for c in result.completions} == {FinishReason.LENGTH}
    assert any(c.stop_reason == "kv_capacity" for c in result.completions)
    assert_no_blocks_in_use(engine)


def test_tenant_cache_fraction_keeps_one_tenant_from_flushing_anothers_prefix() -> None:
    """32 blocks, quota 1/4: tenant "a" keeps its system prompt cached while tenant "b"
    streams many distinct prompts through; without the quota b's prompts evict it."""
    system = list(range(2, 26))  # 6 full blocks of 4

    def a_hit_after_b_flood(fraction: float) -> tuple[int, int]:
        engine, _ = make(num_blocks=32, tenant_cache_fraction=fraction)
        engine.generate(
            [system + [30]], SamplingParams(temperature=0, max_tokens=2, cache_salt="a")
        )
        for i in range(12):  # 12 x 5 idle blocks of b, more than the pool
            engine.generate(
                [[40 + i] * 21], SamplingParams(temperature=0, max_tokens=1, cache_salt="b")
            )
        out = engine.generate(
            [system + [31]], SamplingParams(temperature=0, max_tokens=2, cache_salt="a")
        )
        assert_no_blocks_in_use(engine)
        return out[0].usage.cached_tokens, engine.kv.stats().tenant_quota_evictions

    assert a_hit_after_b_flood(1.0) == (0, 0)
    cached, evictions = a_hit_after_b_flood(0.25)
    assert cached == 24 and evictions > 0


def test_prompt_keys_hashed_by_the_caller_claim_the_same_blocks() -> None:
    """The worker hashes a prompt once, outside the engine lock, and hands the keys in; the
    queue then counts exactly as if the scheduler had hashed them itself."""
    from worker.kv import block_keys

    prefix = list(range(30, 54))
    prompts = [prefix + [7, 8], prefix + [9, 10, 11], prefix[:8] + [5, 6, 7, 8, 9]]
    counts = []
    for hashed in (False, True):
        engine, _ = make(max_num_batched_tokens=64, max_num_seqs=1)
        engine.add_request(list(range(2, 12)), SamplingParams(temperature=0, max_tokens=50))
        engine.step()
        for p in prompts:
            keys = block_keys(p, 4, engine.hash_context(GREEDY)) if hashed else None
            engine.add_request(p, GREEDY, prompt_keys=keys)
        counts.append(
            (engine.metrics().queued_prefill_tokens, dict(engine.scheduler.waiting.claims))
        )
        run_all(engine)
        assert_no_blocks_in_use(engine)
    assert counts[0] == counts[1] and counts[0][0] == 26 + 3 + 5
