"""The output processor decides (tokens, stops, beam plans) without touching blocks or queues;
the scheduler applies its outcomes: appends tokens, forks and frees blocks, finishes requests."""

from __future__ import annotations

import pytest

from tests.engine.fakes import FakeExecutor, reference_generate
from tests.engine.helpers import assert_no_blocks_in_use, run_all
from worker.engine import Engine, EngineConfig, FinishReason, SamplingParams
from worker.engine.outcome import RequestOutcome
from worker.engine.scheduler import Scheduler


def make(num_blocks: int = 64) -> Engine:
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_model_len=256)
    return Engine(FakeExecutor(num_blocks, 4), config)


def test_processor_decides_and_the_scheduler_frees_and_finishes() -> None:
    engine = make()
    pa, pb = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    a = engine.add_request(pa, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    b = engine.add_request(pb, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    ra, rb = engine.requests[a], engine.requests[b]
    sched = engine.scheduler.schedule()
    logits = engine.executor.execute(sched.chunks)
    assert engine.kv.stats().used_blocks == 2 + 1

    outcomes = {o.req.request_id: o for o in engine.processor.process(sched, logits)}
    # decided, nothing applied: no token appended, no block freed, nobody finished
    assert engine.kv.stats().used_blocks == 3
    assert ra.seqs[0].token_ids == pa and rb.seqs[0].token_ids == pb
    assert engine.scheduler.take_finished() == []
    (oa,), (ob,) = outcomes[a].seqs, outcomes[b].seqs
    assert (oa.token, oa.finish) == (
        reference_generate(pa, 1, ignore_eos=True)[0],
        FinishReason.LENGTH,
    )
    assert (ob.token, ob.finish) == (reference_generate(pb, 1, ignore_eos=True)[0], None)
    assert outcomes[a].num_tokens == 1 and outcomes[a].error is None

    for out in outcomes.values():
        engine.scheduler.update_from_output(out)
    assert engine.scheduler.take_finished() == [ra]  # handed to the engine once
    assert engine.scheduler.take_finished() == []
    assert ra.finished and not ra.seqs and ra.done_seqs[0].finish_reason is FinishReason.LENGTH
    assert ra.done_seqs[0].token_ids == [*pa, oa.token]
    assert not engine.kv.has_seq(ra.done_seqs[0].seq_id)  # a's two blocks given back at once
    assert engine.kv.stats().used_blocks == 1
    assert engine.scheduler.running == [rb] and rb.seqs[0].token_ids == [*pb, ob.token]
    assert rb.seqs[0].new_tokens == [ob.token] and rb.progressed


def test_scheduler_forks_and_prunes_beams_as_the_plan_says() -> None:
    engine = make()
    prompt = [5, 6, 7, 8, 9, 10]
    rid = engine.add_request(prompt, SamplingParams(beam_width=2, max_tokens=4, ignore_eos=True))
    req = engine.requests[rid]
    engine.step()  # the prompt, then the first beam step: two beams off the prompt
    first, second = req.seqs
    assert engine.kv.block_table(first.seq_id) == engine.kv.block_table(second.seq_id)
    engine.kv.check_invariants()

    # plan: both new beams descend from beam 1; beam 0 is pruned
    engine.scheduler.update_from_output(RequestOutcome(req, beams=[(1, 40), (1, 41)]))
    assert not engine.kv.has_seq(first.seq_id)  # pruned: its blocks back at once
    keep, child = req.seqs
    assert keep is second and keep.token_ids[-1] == 40 and keep.index == 0
    assert child.token_ids == [*keep.token_ids[:-1], 41] and child.index == 1
    assert engine.kv.block_table(child.seq_id) == engine.kv.block_table(keep.seq_id)  # shared
    engine.kv.check_invariants()

    engine.scheduler.update_from_output(RequestOutcome(req, beams=[], beam_done=True))
    assert req.finished and not req.seqs and engine.scheduler.take_finished() == [req]
    assert engine.kv.stats().used_blocks == 0


def test_parallel_samples_fork_the_prompt_blocks_once() -> None:
    engine = make()
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    req = engine.requests[rid]
    engine.step()
    assert len(req.seqs) == 3 and req.forked
    tables = {tuple(engine.kv.block_table(s.seq_id)) for s in req.seqs}
    assert len(tables) == 1 and engine.kv.stats().used_blocks == 2  # one prompt, shared
    res = run_all(engine)[rid]
    assert sorted(c.index for c in res.completions) == [0, 1, 2]
    assert all(c.finish_reason is FinishReason.LENGTH for c in res.completions)
    assert [s.num_output for s in req.done_seqs] == [5, 5, 5]
    assert_no_blocks_in_use(engine)


def test_capacity_outcome_ends_every_sample_with_length() -> None:
    engine = make()
    rid = engine.add_request([5, 6, 7], SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    req = engine.requests[rid]
    engine.step()
    out = engine.processor.capacity(req)
    assert [(o.token, o.finish, o.stop_reason) for o in out.seqs] == [
        (None, FinishReason.LENGTH, "kv_capacity")
    ] * 2
    engine.scheduler.update_from_output(out)
    assert req.finished and {s.finish_reason for s in req.done_seqs} == {FinishReason.LENGTH}
    assert engine.kv.stats().used_blocks == 0


@pytest.mark.parametrize("where", ["fork_samples", "update_from_output"])
def test_a_request_failing_in_the_scheduler_update_ends_alone(monkeypatch, where) -> None:
    engine = make()
    params = SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)
    ok = engine.add_request([5, 6, 7, 8, 9], params)
    bad = engine.add_request([9, 8, 7, 6, 5], params)
    original = getattr(Scheduler, where)

    def broken(self, *args):  # noqa: ANN001, ANN202
        req = args[0].req if where == "update_from_output" else args[0]
        if req.request_id == bad:
            raise ZeroDivisionError(f"injected in {where}")
        return original(self, *args)

    monkeypatch.setattr(Scheduler, where, broken)
    res = run_all(engine)
    assert res[bad].error is not None and f"injected in {where}" in res[bad].error
    assert all(c.finish_reason is FinishReason.ABORT for c in res[bad].completions)
    assert res[ok].error is None and len(res[ok].completions) == 2
    want = reference_generate([5, 6, 7, 8, 9], 4, ignore_eos=True)
    assert all(c.token_ids == want for c in res[ok].completions)
    assert not engine.requests and engine.snapshot().num_finished == 2
    assert_no_blocks_in_use(engine)
