"""A step's model input built from per-sequence rows kept across steps (a persistent batch).

A running sequence keeps a row in host arrays from one step to the next: its block table and
where its computed tokens end. A chunk writes only the table entries it can have changed, the
blocks its new tokens land in (a block appended, or the partial last block replaced by its
copy-on-write copy): the blocks before them are full, and a full block of an allocated
sequence never changes. Two rules keep the rows true without asking the KV manager:

* a sequence not scheduled in a step loses its row (finished, preempted, waiting for a
  sibling), so one that comes back, perhaps on other blocks, is written whole;
* a chunk that does not start where its row's last chunk ended is written whole too.

Rows stay compact: a removed row takes the last row's contents (swap with last), so a step's
block tables are one gather of its rows. Per-token fields (token ids aside: positions, KV
slots) come from a few vectorised operations over per-chunk lists, not a loop per token; the
Python work per step is a few list appends per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.engine.sched_output import ScheduledChunk
from worker.model.inputs import ModelInput, WantLogits


class InputBatch:
    """The rows of the sequences scheduled last step, and :meth:`build` for the next one."""

    def __init__(self, block_size: int, device: torch.device, rows: int = 64) -> None:
        self.block_size = block_size
        self.device = device
        self._tables = np.zeros((rows, 16), dtype=np.int64)  # [row, logical block] -> block id
        self._end = np.zeros(rows, dtype=np.int64)  # tokens computed through the row's last chunk
        self._row: dict[int, int] = {}  # seq_id -> row
        self._seq: list[int] = []  # row -> seq_id
        self._stamp: list[int] = []  # row -> the step that last scheduled it
        self._step = 0

    def __len__(self) -> int:
        return len(self._seq)

    def row_of(self, seq_id: int) -> int | None:
        return self._row.get(seq_id)

    def table(self, seq_id: int, num_blocks: int) -> list[int]:
        """The first ``num_blocks`` entries of a sequence's row (tests and checks)."""
        return self._tables[self._row[seq_id], :num_blocks].tolist()

    def build(self, chunks: Sequence[ScheduledChunk], wants: Sequence[WantLogits]) -> ModelInput:
        """The flat input of ``chunks`` in their order (as ``ModelInput.build`` lays it out);
        ``wants[i]``: which logits chunk ``i`` returns. Updates the rows."""
        if not chunks:
            raise ValueError("InputBatch.build needs at least one chunk")
        self._step += 1
        step, bs = self._step, self.block_size
        rows: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        ids: list[int] = []
        logit_rows: list[int] = []
        width = tok = 0
        for i, (c, want) in enumerate(zip(chunks, wants, strict=True)):
            seq, start, n = c.seq, c.start, c.num_tokens
            table = c.block_table
            hi = (start + n - 1) // bs + 1  # blocks covering the context through this chunk
            if n < 1 or start < 0 or len(table) < hi:
                raise ValueError(
                    f"chunk {i}: needs >= 1 new token, start >= 0 and a block table of "
                    f">= {hi} blocks (got {n} tokens at {start}, {len(table)} blocks)"
                )
            if hi > self._tables.shape[1]:
                self._widen(hi)
            row = self._row.get(seq.seq_id)
            if row is None:
                row = self._add(seq.seq_id)  # ends at -1: written whole (may grow the arrays)
            tables = self._tables
            if self._end[row] != start:
                tables[row, :hi] = table[:hi]
            elif hi - start // bs == 1:  # a decode, or a chunk within one block
                tables[row, hi - 1] = table[hi - 1]
            else:
                tables[row, start // bs : hi] = table[start // bs : hi]
            self._end[row] = start + n
            self._stamp[row] = step
            rows.append(row)
            starts.append(start)
            counts.append(n)
            if n == 1:
                ids.append(seq.token_ids[start])
            elif c.drafts:  # the next token, then the drafts to verify
                ids.extend(c.token_ids)
            else:
                ids.extend(seq.token_ids[start : start + n])
            if want == "last":
                logit_rows.append(tok + n - 1)
            elif want == "all":
                logit_rows.extend(range(tok, tok + n))
            elif want != "none":
                raise ValueError(f"chunk {i}: want_logits={want!r}")
            tok += n
            width = max(width, hi)
        block_tables = self._tables[rows, :width]  # a copy: rows may move below
        if len(self._row) > len(chunks):
            self._evict(step)
        return self._assemble(ids, starts, counts, logit_rows, block_tables)

    def _assemble(
        self,
        ids: list[int],
        starts: list[int],
        counts: list[int],
        logit_rows: list[int],
        block_tables: np.ndarray,
    ) -> ModelInput:
        bs, n_seqs, n_tokens = self.block_size, len(counts), len(ids)
        start = np.asarray(starts, dtype=np.int64)
        count = np.asarray(counts, dtype=np.int64)
        cu = np.zeros(n_seqs + 1, dtype=np.int64)
        np.cumsum(count, out=cu[1:])
        if n_tokens == n_seqs:  # decodes only: one token per sequence
            owner = np.arange(n_seqs)
            positions = start
        else:
            owner = np.repeat(np.arange(n_seqs), count)
            positions = np.arange(n_tokens) - cu[:-1][owner] + start[owner]
        slots = block_tables[owner, positions // bs] * bs + positions % bs
        seq_lens = start + count
        parts = (
            np.asarray(ids, dtype=np.int64),
            positions,
            slots,
            np.asarray(logit_rows, dtype=np.int64),
            cu,
            seq_lens,
            block_tables.reshape(-1),
        )
        return ModelInput.from_host(
            torch.from_numpy(np.concatenate(parts)),
            [len(p) for p in parts],
            (n_seqs, block_tables.shape[1]),
            self.device,
            tuple(counts),
            tuple(seq_lens.tolist()),
        )

    # ---- rows ----------------------------------------------------------------------------

    def _add(self, seq_id: int) -> int:
        row = len(self._seq)
        if row == self._tables.shape[0]:
            grown = np.zeros((2 * row, self._tables.shape[1]), dtype=np.int64)
            grown[:row] = self._tables
            self._tables = grown
            self._end = np.concatenate([self._end, np.zeros(row, dtype=np.int64)])
        self._end[row] = -1
        self._row[seq_id] = row
        self._seq.append(seq_id)
        self._stamp.append(self._step)
        return row

    def _widen(self, blocks: int) -> None:
        rows, width = self._tables.shape
        wide = np.zeros((rows, max(blocks, 2 * width)), dtype=np.int64)
        wide[:, :width] = self._tables
        self._tables = wide

    def _evict(self, step: int) -> None:
        """Drop the rows of sequences this step did not schedule (swap with last)."""
        for seq_id in [s for s, t in zip(self._seq, self._stamp, strict=True) if t != step]:
            self._remove(seq_id)

    def _remove(self, seq_id: int) -> None:
        row = self._row.pop(seq_id)
        last = len(self._seq) - 1
        if row != last:
            moved = self._seq[last]
            self._tables[row] = self._tables[last]
            self._end[row] = self._end[last]
            self._seq[row], self._stamp[row] = moved, self._stamp[last]
            self._row[moved] = row
        self._seq.pop()
        self._stamp.pop()
