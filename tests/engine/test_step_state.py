"""State the engine keeps between steps instead of rebuilding it (block tables, sample specs,
the waiting queue's pinned-block count) always equals what rebuilding it would give, and the
tokens of a busy, preempting, aborting engine are those of a reference that keeps nothing."""

from __future__ import annotations

import random
import time

from tests.engine.fakes import FakeExecutor, reference_generate
from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.sampler import SampleSpec


def _check_kept_state(engine: Engine) -> None:
    engine.kv.check_invariants()  # a kept block table equals the blocks' ids
    for req in engine.scheduler.running:
        for seq in req.seqs:
            if seq.allocated:
                table = engine.kv.block_table(seq.seq_id)
                assert table == [b.block_id for b in engine.kv.seqs[seq.seq_id].blocks]
            if seq.spec is not None:  # kept only once nothing is banned: what a rebuild gives
                rebuilt = SampleSpec(req.params, seq.generator, engine.processor.banned(req, seq))
                assert seq.spec == rebuilt, (req.request_id, seq.spec, rebuilt)
    waiting = engine.scheduler.waiting
    recount = engine.kv.num_evictable_of(waiting.claims) if len(waiting) else 0
    assert waiting.pinned_blocks() == recount


def test_kept_state_matches_a_rebuild_through_preemption_forks_and_aborts() -> None:
    """A small pool (preemption, copy-on-write of forked samples), shared prefixes, min_tokens,
    n > 1 and aborts at random: after every step the kept state equals a rebuild, and every
    greedy n == 1 request that ran to its end gave the reference tokens."""
    rng = random.Random(7)
    engine = Engine(
        FakeExecutor(24, 4),
        EngineConfig(
            block_size=4,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=24,
            admission_watermark=0.0,
        ),
    )
    shared = [rng.randrange(2, 64) for _ in range(9)]
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for step in range(400):
        if step < 300 and rng.random() < 0.5:
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(2, 64) for _ in range(rng.randint(1, 10))
            ]
            n = rng.choice((1, 1, 2))
            max_tokens = rng.randint(1, 14)
            params = SamplingParams(
                temperature=0 if n == 1 else 0.8,
                seed=step,
                n=n,
                max_tokens=max_tokens,
                min_tokens=min(max_tokens, rng.choice((0, 0, 3))),
                ignore_eos=rng.random() < 0.5,
            )
            rid = engine.add_request(prompt, params)
            if n == 1:
                expected[rid] = reference_generate(
                    prompt,
                    params.max_tokens,
                    ignore_eos=params.ignore_eos,
                    min_tokens=params.min_tokens,
                )
        if engine.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(engine.requests))
            engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(out.request_id, []).extend(d.token_ids)
        _check_kept_state(engine)
        if step >= 300 and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert engine.stats.num_preemptions > 0  # the pool was tight enough to matter
    done = [r for r in expected if r not in aborted]
    assert len(done) > 20
    for rid in done:
        assert got.get(rid, []) == expected[rid], rid
    assert_no_blocks_in_use(engine)


def test_pinned_blocks_recount_at_most_every_max_age_and_zero_once_the_queue_empties() -> None:
    """Asked after every step with a max age, the count is the last recount until that age
    passes; asked without one, it is exact; an empty queue pins nothing at once."""
    engine = Engine(
        FakeExecutor(64, 4),
        EngineConfig(block_size=4, max_model_len=256, max_num_seqs=1, max_num_batched_tokens=64),
    )
    prefix = list(range(30, 54))  # 6 full blocks of 4
    greedy = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request(prefix + [7], greedy)
    while engine.has_unfinished_requests():
        engine.step()  # the prefix is cached, nothing holds it
    engine.add_request(list(range(2, 12)), SamplingParams(temperature=0, max_tokens=40))
    engine.step()  # it runs (max_num_seqs=1): the next ones wait
    engine.add_request(prefix + [9], greedy)
    waiting = engine.scheduler.waiting
    assert engine.snapshot(pins_max_age_s=30.0).waiting_pinned_blocks == 6
    engine.add_request(list(range(30, 42)) + [5], greedy)  # claims 3 of those blocks again
    seq = next(iter(waiting)).seqs[0]
    engine.kv.pool.order.mark_landed(engine.kv.pool.cached[k] for k in seq.claim[:2])
    assert engine.snapshot(pins_max_age_s=30.0).waiting_pinned_blocks == 6  # the last count
    assert engine.snapshot().waiting_pinned_blocks == 4  # exact: 2 landed are the router's
    assert engine.snapshot(pins_max_age_s=30.0).waiting_pinned_blocks == 4  # just counted
    engine.kv.pool.order.mark_landed(engine.kv.pool.cached[k] for k in seq.claim[2:3])
    time.sleep(0.03)
    assert engine.snapshot(pins_max_age_s=0.02).waiting_pinned_blocks == 3  # old: recounted
    for req in list(waiting):
        engine.abort(req.request_id)
    assert engine.snapshot(pins_max_age_s=30.0).waiting_pinned_blocks == 0
