"""Reference paged attention in plain torch (CPU and CUDA).

K/V are read by gathering whole physical blocks through the block table into a contiguous
per-sequence view, then ``scaled_dot_product_attention`` with an explicit mask does the rest.
Decodes (one new token) of a step are batched into one call; each prefill (or prefill chunk)
gets its own call with a bottom-right-aligned causal mask over cached prefix + new tokens; a
prompt with nothing cached attends to its own new K/V directly (causal, no gather, no mask).
Simple and exact rather than fast: this is the reference the CUDA kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from worker.attention.backend_registry import register_backend
from worker.attention.base import AttentionBackend, AttentionMetadata, write_kv


@dataclass(frozen=True)
class _Prefill:
    """One sequence with more than one new token."""

    seq: int  # index in the batch
    start: int  # first row of its new tokens in q/k/v
    end: int  # one past its last row
    seq_len: int  # context length incl. the new tokens


@dataclass(frozen=True)
class TorchPlan:
    """Per-step split of the batch into batched decodes and individual prefills."""

    meta: AttentionMetadata  # the step's metadata
    decode_rows: torch.Tensor | None  # int64 [num_decodes]: row of each decode token; None if none
    decode_block_tables: torch.Tensor | None  # [num_decodes, blocks needed by the longest]
    decode_seq_lens: torch.Tensor | None  # int64 [num_decodes, 1]
    decode_lens_host: tuple[int, ...]  # host copy: context length of each decode
    prefills: tuple[_Prefill, ...]  # sequences with > 1 new token
    # the prefills again, in runs: neighbours in the batch that are whole prompts of one
    # length (nothing cached) form one run, attended in one batched call
    prefill_runs: tuple[tuple[_Prefill, ...], ...] = ()

    @property
    def decode_max_len(self) -> int:
        """Longest context among the decodes (0 if none)."""
        return max(self.decode_lens_host, default=0)


def gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of the first ``length`` positions, read through ``blocks`` (1-D or 2-D).

    Returns ``[..., length, kv_heads, head_dim]``.
    """
    gathered = cache[blocks.long()]  # [..., nblocks, block_size, kvh, d]
    merged = gathered.flatten(-4, -3)
    return merged[..., :length, :, :]


def _fresh_runs(prefills: tuple[_Prefill, ...]) -> tuple[tuple[_Prefill, ...], ...]:
    """``prefills`` cut into runs: adjacent whole prompts (nothing cached, ``end - start ==
    seq_len``) of one length share a run; every other prefill is a run of its own."""
    runs: list[list[_Prefill]] = []
    for p in prefills:
        n = p.end - p.start
        if runs and n == p.seq_len:
            last = runs[-1][-1]
            if last.end == p.start and last.end - last.start == n == last.seq_len:
                runs[-1].append(p)
                continue
        runs.append([p])
    return tuple(tuple(run) for run in runs)


def context_mask(
    q_pos: torch.Tensor, length: int, seq_len: torch.Tensor | int, window: int | None
) -> torch.Tensor:
    """Boolean [..., num_q, length]: key position k is visible to query position q."""
    k_pos = torch.arange(length, device=q_pos.device)
    visible = k_pos <= q_pos[..., None]
    if isinstance(seq_len, torch.Tensor):
        visible = visible & (k_pos < seq_len[..., None])
    if window is not None:
        visible = visible & (k_pos > q_pos[..., None] - window)
    return visible


@register_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    # the longest chunk on top of a cached prefix attended as decode rows, one per new token
    # (row j sees the context up to itself): 1 here; the CPU backend's native decode kernel
    # takes speculative verify chunks (a token and its drafts) so
    decode_chunk = 1

    def prepare(self, meta: AttentionMetadata) -> TorchPlan:
        starts = [0, *accumulate(meta.query_lens_host)]
        rows: list[int] = []
        seqs: list[int] = []
        lens: list[int] = []
        prefills = []
        for i, n in enumerate(meta.query_lens_host):
            seq_len = meta.seq_lens_host[i]
            if n == 1 or (1 < n <= self.decode_chunk and n < seq_len):
                rows += range(starts[i], starts[i] + n)
                seqs += [i] * n
                lens += range(seq_len - n + 1, seq_len + 1)
            elif n > 1:
                prefills.append(_Prefill(i, starts[i], starts[i + 1], seq_len))
        runs = _fresh_runs(tuple(prefills))
        if not rows:
            return TorchPlan(meta, None, None, None, (), tuple(prefills), runs)
        device = meta.block_tables.device
        idx = torch.tensor(seqs, dtype=torch.long, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.long, device=device)[:, None]
        tables = meta.block_tables.index_select(0, idx)
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        return TorchPlan(meta, rows_t, tables, seq_lens, tuple(lens), tuple(prefills), runs)

    def forward(self, q, k, v, k_cache, v_cache, prepared: TorchPlan, sliding_window=None):
        write_kv(k, v, k_cache, v_cache, prepared.meta.slot_mapping)
        out = q.new_empty(q.shape)
        if prepared.decode_rows is not None:
            self._decodes(q, k_cache, v_cache, prepared, sliding_window, out)
        for run in prepared.prefill_runs:
            n = run[0].end - run[0].start
            if len(run) > 1 and (sliding_window is None or n <= sliding_window):
                # whole prompts of one length, adjacent: one causal call over [len(run), n]
                lo, hi, heads = run[0].start, run[-1].end, q.shape[1:]
                out[lo:hi] = self._sdpa(
                    q[lo:hi].view(len(run), n, *heads),
                    k[lo:hi].view(len(run), n, *k.shape[1:]),
                    v[lo:hi].view(len(run), n, *v.shape[1:]),
                ).reshape(hi - lo, *heads)
                continue
            for p in run:
                self._prefill(q, k, v, k_cache, v_cache, prepared.meta, p, sliding_window, out)
        return out

    def _decodes(self, q, k_cache, v_cache, prepared: TorchPlan, sliding_window, out) -> None:
        """All one-token sequences of the step in one batched call over gathered contexts."""
        longest = prepared.decode_max_len
        blocks = prepared.decode_block_tables[:, : -(-longest // k_cache.shape[1])]
        keys = gather_context(k_cache, blocks, longest)  # [B, L, kvh, d]
        values = gather_context(v_cache, blocks, longest)
        q_pos = prepared.decode_seq_lens - 1  # [B, 1]
        mask = context_mask(q_pos, longest, prepared.decode_seq_lens, sliding_window)
        rows = prepared.decode_rows
        out[rows] = self._sdpa(q[rows][:, None], keys, values, mask)[:, 0]

    def _prefill(self, q, k, v, k_cache, v_cache, meta, p: _Prefill, sliding_window, out) -> None:
        """One sequence's new tokens (a prompt or a chunk on top of its cached prefix)."""
        n = p.end - p.start
        if n == p.seq_len and (sliding_window is None or n <= sliding_window):
            # Nothing cached before the chunk: its own k/v are the whole context, so attend
            # causally to them directly (no gather, no explicit mask).
            out[p.start : p.end] = self._sdpa(
                q[None, p.start : p.end], k[None, p.start : p.end], v[None, p.start : p.end]
            )[0]
            return
        blocks = meta.block_tables[p.seq, : -(-p.seq_len // k_cache.shape[1])]
        keys = gather_context(k_cache, blocks, p.seq_len)[None]
        values = gather_context(v_cache, blocks, p.seq_len)[None]
        q_pos = torch.arange(p.seq_len - n, p.seq_len, device=q.device)
        mask = context_mask(q_pos, p.seq_len, p.seq_len, sliding_window)[None]
        out[p.start : p.end] = self._sdpa(q[None, p.start : p.end], keys, values, mask)[0]

    def _sdpa(self, q, keys, values, mask=None) -> torch.Tensor:
        """q [B, n, H, d], keys/values [B, L, kvh, d], mask [B, n, L] -> [B, n, H, d].

        Without a mask: causal with n == L (a fresh prompt)."""
        result = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=None if mask is None else mask[:, None],
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return result.transpose(1, 2)
