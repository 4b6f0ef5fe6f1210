"""The penalties' device token counts, kept incrementally, equal a from-scratch recount.

Unit level: random appends, forks, finished sequences whose rows are reused, and table growth.
Engine level: parallel samples (n > 1) with penalties under recompute and swap preemption;
every step's rows are checked against a recount of the sequences' tokens, and the outputs
equal those of an engine that recounts every step (what the sampler did before).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.helpers import assert_no_blocks_in_use, run_all
from tests.engine.test_host_tier import make
from worker.engine import Engine, SamplingParams
from worker.engine.logit_adjust import PenaltyRows, token_counts
from worker.engine.penalties import PenaltyCounts
from worker.engine.request import Sequence

VOCAB = 64
CPU = torch.device("cpu")


def recount(seqs: list[tuple[Sequence, SamplingParams]], vocab: int) -> PenaltyRows:
    """The counts the sampler computed every step before: from the token ids."""
    out = token_counts([s.output_ids for s, _ in seqs], vocab, CPU)
    seen = token_counts([s.token_ids[: s.prompt_len] for s, _ in seqs], vocab, CPU) > 0
    return PenaltyRows(out, seen)


def assert_rows_equal(got: PenaltyRows, seqs: list[tuple[Sequence, SamplingParams]]) -> None:
    want = recount(seqs, got.output.shape[1])
    assert torch.equal(got.output.cpu(), want.output)
    rep = [i for i, (_, p) in enumerate(seqs) if p.repetition_penalty != 1.0]
    assert torch.equal(got.prompt_seen.cpu()[rep], want.prompt_seen[rep])  # the rows it reads


def test_rows_equal_a_recount_through_appends_forks_and_reuse() -> None:
    rng = random.Random(0)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=1.0, repetition_penalty=0.8),
    ]
    counts = PenaltyCounts()

    def new_seq() -> tuple[Sequence, SamplingParams]:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        return Sequence(0, prompt, len(prompt), None, None), rng.choice(params)

    live = [new_seq() for _ in range(5)]
    for _ in range(200):
        for seq, _ in live:
            seq.token_ids += [rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 1, 3]))]
        r = rng.random()
        if r < 0.15 and len(live) > 1:  # a sequence ends: its row is freed and reused
            seq, _ = live.pop(rng.randrange(len(live)))
            counts.release(seq.seq_id)
        elif r < 0.35:  # a fork: a new sequence with the parent's history
            seq, p = rng.choice(live)
            live.append((seq.fork(1, None, None), p))
        elif r < 0.5:
            live.append(new_seq())
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))  # not all run every step
        assert_rows_equal(counts.rows(batch, VOCAB, CPU), batch)
    assert len(counts) <= len(live) + 200  # rows of ended sequences were released
    for seq, _ in live:
        counts.release(seq.seq_id)
    assert len(counts) == 0


def test_rows_grow_past_the_initial_table_and_keep_their_counts() -> None:
    counts = PenaltyCounts()
    p = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)
    seqs = [(Sequence(0, [i, i + 1], 2, None, None), p) for i in range(30)]
    for step in range(3):
        for k, (seq, _) in enumerate(seqs):
            seq.token_ids.append((k * 7 + step) % VOCAB)
        batch = seqs[: 10 * (step + 1)]  # 10, 20, 30 rows: two growths
        assert_rows_equal(counts.rows(batch, VOCAB, CPU), batch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_on_cuda_equal_a_recount() -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    counts = PenaltyCounts()
    p = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3)
    rng = random.Random(5)
    seqs = [(Sequence(0, [rng.randrange(VOCAB) for _ in range(50)], 50, None, None), p)]
    seqs.append((seqs[0][0].fork(1, None, None), p))
    for _ in range(20):
        for seq, _ in seqs:
            seq.token_ids.append(rng.randrange(VOCAB))
        rows = counts.rows(seqs, VOCAB, cuda)
        assert rows.output.device == cuda
        assert_rows_equal(rows, seqs)


def test_an_id_outside_the_vocabulary_raises_and_changes_nothing() -> None:
    counts = PenaltyCounts()
    p = SamplingParams(repetition_penalty=1.2)
    good = Sequence(0, [1, 2, 3], 3, None, None)
    bad = Sequence(0, [4, VOCAB + 5], 2, None, None)
    counts.rows([(good, p)], VOCAB, CPU)
    good.token_ids.append(9)
    with pytest.raises(ValueError, match=f"token id {VOCAB + 5}"):
        counts.rows([(good, p), (bad, p)], VOCAB, CPU)
    assert len(counts) == 1
    assert_rows_equal(counts.rows([(good, p)], VOCAB, CPU), [(good, p)])  # 9 counted once


def _run(mode: str, spy: bool, seed: int) -> tuple[Engine, dict, int]:
    engine, _ = make(
        28,
        128 if mode == "swap" else 0,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        preemption_mode=mode,
    )
    counts = engine.processor.penalties
    real = counts.rows
    checked = 0

    def checked_rows(seqs, vocab, device):  # noqa: ANN001, ANN202
        nonlocal checked
        got = real(seqs, vocab, device)
        assert_rows_equal(got, list(seqs))
        checked += 1
        return got

    def recounted(seqs, vocab, device):  # noqa: ANN001, ANN202 - the old way, every step
        return recount(list(seqs), vocab)

    counts.rows = checked_rows if spy else recounted  # type: ignore[method-assign]
    rng = random.Random(seed)
    kinds = [
        dict(repetition_penalty=1.4),
        dict(frequency_penalty=1.5, presence_penalty=0.5),
        dict(repetition_penalty=0.7, frequency_penalty=0.5),
        dict(),
    ]
    ids = []
    for i in range(8):
        prompt = [rng.randrange(2, 64) for _ in range(rng.randint(20, 36))]
        params = SamplingParams(
            temperature=0.0 if i % 3 == 0 else 0.9,
            seed=i,
            n=2 if i < 4 else 1,
            max_tokens=24,
            ignore_eos=True,
            **kinds[i % len(kinds)],
        )
        ids.append(engine.add_request(prompt, params, request_id=f"r{i}"))
    results = run_all(engine)
    out = {rid: [c.token_ids for c in results[rid].completions] for rid in ids}
    assert all(not results[rid].error for rid in ids)
    assert_no_blocks_in_use(engine)
    assert len(counts) == 0  # every row released when its request finished
    return engine, out, checked


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_counts_equal_a_recount_through_preemption_with_n_samples(mode: str) -> None:
    engine, incremental, checked = _run(mode, spy=True, seed=3)
    m = engine.metrics()
    assert m.num_preemptions > 0, m
    assert (m.num_swap_preemptions > 0) == (mode == "swap"), m
    assert checked > 24  # the rows were checked on every sampling step
    _, recounted, _ = _run(mode, spy=False, seed=3)
    assert incremental == recounted
