"""Token counts for the sampling penalties, kept on the sampler's device across steps.

Presence and frequency penalties read how often each token occurs in a sequence's output;
the repetition penalty also which tokens its prompt holds. Counting them afresh each step
costs O(prompt + output) host work and copies per sequence and step. Here every sequence
that sets a penalty owns a row of two device tables, filled from its prompt (and any output
it already has) the first time it samples, then caught up with the tokens appended since: one
per decode step. A step therefore costs O(batch) host work, one small host-to-device copy, a
scatter and a gather, whatever the context length.

A row lives as long as its sequence: preemption (recompute or swap) keeps it, since the
sequence's tokens do not change; the caller releases it when the sequence ends. Forked
samples (``n`` > 1) are new sequences and fill their own row from their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvstore.requests.sampling_params import SamplingParams
from worker.engine.host_copies import to_device
from worker.engine.logit_adjust import PenaltyRows
from worker.engine.request import Sequence

_MIN_ROWS = 8


@dataclass(slots=True)
class _Row:
    index: int  # row of the tables
    counted: int  # output tokens counted so far (a prefix of the sequence's output)
    seen: bool  # prompt tokens marked in the seen table (only for a repetition penalty)


class PenaltyCounts:
    """Per-sequence output counts and prompt-seen flags on one device (see module doc).

    Not thread-safe: used by the engine thread only. Callers must :meth:`release` every
    sequence they passed to :meth:`rows` once it ends (a leaked row only costs memory).
    """

    def __init__(self) -> None:
        self._out: torch.Tensor | None = None  # [capacity, vocab] float32 output counts
        self._seen: torch.Tensor | None = None  # [capacity, vocab] bool: in the prompt
        self._rows: dict[int, _Row] = {}  # seq_id -> its row
        self._free: list[int] = []  # rows not in use

    def __len__(self) -> int:
        return len(self._rows)

    def rows(
        self, seqs: Seq[tuple[Sequence, SamplingParams]], vocab: int, device: torch.device
    ) -> PenaltyRows:
        """The rows of ``seqs`` (each sets a penalty), in order, up to date with their tokens.

        Raises ``ValueError`` for a token id outside ``[0, vocab)``, before changing anything.
        """
        self._reset_for(vocab, device)
        plan: list[tuple[Sequence, _Row | None, list[int], bool]] = []
        for seq, params in seqs:
            row = self._rows.get(seq.seq_id)
            first = seq.output_start  # a moved stream's earlier output counts as output
            num_output = len(seq.token_ids) - first
            if row is not None and row.counted > num_output:  # not a prefix any more
                row = None
            new = seq.token_ids[first + (row.counted if row is not None else 0) :]
            seen = params.repetition_penalty != 1.0 and (row is None or not row.seen)
            _check_ids(new, vocab)
            if seen:
                _check_ids(seq.token_ids[:first], vocab)
            plan.append((seq, row, new, seen))
        self._grow(vocab, device, sum(row is None for _, row, _, _ in plan))
        index, fresh, out_rows, out_toks, seen_rows, seen_toks = [], [], [], [], [], []
        for seq, row, new, seen in plan:
            if row is None:
                old = self._rows.pop(seq.seq_id, None)
                row = _Row(old.index if old is not None else self._free.pop(), 0, False)
                self._rows[seq.seq_id] = row
                fresh.append(row.index)
            index.append(row.index)
            out_rows += [row.index] * len(new)
            out_toks += new
            if seen:
                prompt = seq.token_ids[: seq.output_start]
                seen_rows += [row.index] * len(prompt)
                seen_toks += prompt
                row.seen = True
            row.counted = len(seq.token_ids) - seq.output_start
        return self._update(index, fresh, out_rows, out_toks, seen_rows, seen_toks)

    def release(self, seq_id: int) -> None:
        """The sequence ended: its row is free (unknown ids are ignored)."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row.index)

    def _reset_for(self, vocab: int, device: torch.device) -> None:
        """Forget every row if the tables are for another vocabulary or device."""
        out = self._out
        if out is not None and (out.shape[1] != vocab or out.device != device):
            self._out = self._seen = None
            self._rows.clear()
            self._free = []

    def _grow(self, vocab: int, device: torch.device, new_rows: int) -> None:
        """At least ``new_rows`` free rows; the capacity at least doubles when it grows."""
        out, seen = self._out, self._seen
        if out is not None and len(self._free) >= new_rows:
            return
        cap = 0 if out is None else out.shape[0]
        grown = max(_MIN_ROWS, 2 * cap, cap + new_rows - len(self._free))
        self._out = torch.zeros((grown, vocab), dtype=torch.float32, device=device)
        self._seen = torch.zeros((grown, vocab), dtype=torch.bool, device=device)
        if out is not None and seen is not None:
            self._out[:cap] = out
            self._seen[:cap] = seen
        self._free += range(grown - 1, cap - 1, -1)  # popped from the end: lowest first

    def _update(
        self,
        index: list[int],
        fresh: list[int],
        out_rows: list[int],
        out_toks: list[int],
        seen_rows: list[int],
        seen_toks: list[int],
    ) -> PenaltyRows:
        assert self._out is not None and self._seen is not None
        out, seen = self._out, self._seen
        sizes = [len(index), len(fresh), len(out_rows), len(out_toks), len(seen_rows)]
        flat = to_device(
            index + fresh + out_rows + out_toks + seen_rows + seen_toks, torch.long, out.device
        )
        parts = flat.split([*sizes, len(seen_toks)])
        idx, fresh_t, o_rows, o_toks, s_rows, s_toks = parts
        if fresh:  # a reused row holds its last sequence's counts
            out.index_fill_(0, fresh_t, 0.0)
            seen.index_fill_(0, fresh_t, False)
        if out_rows:
            out.index_put_((o_rows, o_toks), torch.ones((), device=out.device), accumulate=True)
        if seen_rows:
            seen.index_put_((s_rows, s_toks), torch.ones((), dtype=torch.bool, device=out.device))
        return PenaltyRows(out.index_select(0, idx), seen.index_select(0, idx))


def _check_ids(ids: list[int], vocab: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
