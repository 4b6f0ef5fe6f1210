"""The persistent input batch builds exactly what ``ModelInput.build`` builds from scratch,
step after step, as sequences grow, copy a block on write, leave and come back."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from worker.engine.input_batch import InputBatch
from worker.engine.sched_output import ScheduledChunk
from worker.model.inputs import ModelInput, SeqChunk

BS = 4


@dataclass
class _Seq:
    seq_id: int
    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


def _chunk(seq: _Seq, n: int, want: bool = True) -> ScheduledChunk:
    start = seq.computed
    seq.computed += n
    while len(seq.blocks) * BS < seq.computed:
        seq.blocks.append(random.randrange(1000))
    return ScheduledChunk(None, seq, start, n, want, list(seq.blocks))  # type: ignore[arg-type]


def _fresh(chunks: list[ScheduledChunk], wants: list[str]) -> ModelInput:
    return ModelInput.build(
        [
            SeqChunk(c.seq.token_ids[c.start : c.start + c.num_tokens], c.start, c.block_table, w)
            for c, w in zip(chunks, wants, strict=True)
        ],
        BS,
    )


def _same(got: ModelInput, want: ModelInput) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "query_start_loc"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.seq_lens, want.seq_lens)
    assert got.query_lens_host == want.query_lens_host
    assert got.seq_lens_host == want.seq_lens_host
    # padding past a row's own blocks is arbitrary: compare the blocks each row needs
    assert got.block_tables.dtype == want.block_tables.dtype == torch.int32
    for i, n in enumerate(want.seq_lens_host):
        used = -(-n // BS)
        assert torch.equal(got.block_tables[i, :used], want.block_tables[i, :used]), i


def _step(batch: InputBatch, chunks: list[ScheduledChunk], wants: list[str]) -> None:
    _same(batch.build(chunks, wants), _fresh(chunks, wants))


def test_rows_follow_growth_copy_on_write_and_eviction():
    random.seed(0)
    seqs = [_Seq(i, list(range(100 * i, 100 * i + 40))) for i in range(5)]
    batch = InputBatch(BS, torch.device("cpu"), rows=2)  # rows and width grow
    _step(batch, [_chunk(s, 6) for s in seqs[:3]], ["last", "none", "all"])
    assert len(batch) == 3
    # decodes and a chunk across a block boundary; seq 3 arrives mid-prompt
    _step(batch, [_chunk(seqs[0], 1), _chunk(seqs[1], 5), _chunk(seqs[3], 3)], ["last"] * 3)
    assert len(batch) == 3 and batch.row_of(2) is None  # not scheduled: its row is gone
    # copy-on-write: the partial block being written is replaced by a copy
    seqs[0].blocks[-1] = 5000
    _step(batch, [_chunk(seqs[0], 1), _chunk(seqs[1], 1)], ["last", "last"])
    assert batch.table(0, len(seqs[0].blocks)) == seqs[0].blocks
    # seq 2 comes back on other blocks (preempted, recomputed from a cached prefix)
    seqs[2].blocks = [7000, 7001]
    seqs[2].computed = 8
    _step(batch, [_chunk(seqs[2], 9), _chunk(seqs[0], 1)], ["last", "last"])
    assert batch.table(2, 5) == seqs[2].blocks
    # long enough to widen the table rows past their first width
    _step(batch, [_chunk(seqs[4], 34), _chunk(seqs[2], 1)], ["last", "last"])
    assert len(batch) == 2


def test_a_chunk_that_does_not_continue_its_row_is_written_whole():
    seq = _Seq(1, list(range(30)))
    batch = InputBatch(BS, torch.device("cpu"))
    _step(batch, [_chunk(seq, 9)], ["last"])
    seq.blocks, seq.computed = [50, 51, 52], 8  # freed and re-allocated between two steps
    _step(batch, [_chunk(seq, 1)], ["last"])
    assert batch.table(1, 3) == [50, 51, 52]


def test_random_steps_match_a_fresh_build():
    rng = random.Random(3)
    random.seed(3)
    batch = InputBatch(BS, torch.device("cpu"), rows=1)
    live: list[_Seq] = []
    next_id = 0
    for _ in range(200):
        if len(live) < 6 and rng.random() < 0.4:
            live.append(_Seq(next_id, [rng.randrange(50) for _ in range(60)]))
            next_id += 1
        if live and rng.random() < 0.1:
            live.pop(rng.randrange(len(live)))
        chosen = [s for s in live if rng.random() < 0.8 and s.computed < 59]
        if not chosen:
            continue
        for s in chosen:
            if s.blocks and rng.random() < 0.1:  # copy-on-write of the block written next
                s.blocks[s.computed // BS :] = [
                    rng.randrange(1000) for _ in s.blocks[s.computed // BS :]
                ]
        chunks = [_chunk(s, min(rng.choice([1, 1, 2, 5]), 59 - s.computed)) for s in chosen]
        _step(batch, chunks, [rng.choice(["last", "all", "none"]) for _ in chunks])
        assert len(batch) == len(chunks)


def test_bad_chunks_are_refused():
    batch = InputBatch(BS, torch.device("cpu"))
    seq = _Seq(1, list(range(10)))
    with pytest.raises(ValueError, match="block table of >= 2 blocks"):
        batch.build([ScheduledChunk(None, seq, 0, 5, True, [1])], ["last"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="want_logits='some'"):
        batch.build([ScheduledChunk(None, seq, 0, 2, True, [1])], ["some"])  # type: ignore[arg-type,list-item]
    with pytest.raises(ValueError, match="at least one chunk"):
        batch.build([], [])
