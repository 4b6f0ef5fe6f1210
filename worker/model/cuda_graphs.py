"""CUDA graphs of decode steps: one captured graph per batch-size bucket.

A decode step (one new token per sequence) launches a few hundred small kernels; replaying a
captured graph launches them as one. Each bucket's graph reads fixed ("static") input
buffers, so a step of ``n`` sequences copies its inputs into the first ``n`` rows and pads
the rest: padded rows decode token 0 at position 0 of a private *pad block* that the KV
manager never hands out (the runner allocates it past ``num_blocks``), so their K/V writes
touch nothing real, and their logits are dropped.

Requirements, checked by ``DecodeGraphs.supported``: a CUDA device and an attention backend
whose ``forward`` does no host work per step (``triton``). The split-K count of the decode
kernel is fixed at capture from the longest context the block tables can hold; the kernel
reads each sequence's real length on the device, so shorter contexts leave splits empty.
Prefill and mixed steps, and batches larger than the largest bucket, run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.attention.base import AttentionMetadata
from worker.model.inputs import ModelInput

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
GRAPH_BACKENDS = ("triton",)


@dataclass
class _Static:
    """The buffers one set of graphs reads and writes (sized for the largest bucket)."""

    input_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]
    slot_mapping: torch.Tensor  # int64 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks]


class DecodeGraphs:
    """Decode steps of one runner through per-bucket graphs (or, with ``capture=False``, the
    same padded static-buffer path run eagerly: what the CPU tests exercise)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        *,
        device: torch.device,
        block_size: int,
        max_blocks_per_seq: int,
        pad_block: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        capture: bool = True,
    ) -> None:
        self._forward = forward  # (input_ids, positions, metadata) -> logits of every row
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.pad_block = pad_block
        self.buckets = tuple(sorted(set(buckets)))
        self.capture = capture
        top = self.buckets[-1]
        # Every row starts as a padding row: capture_all's warm-up runs these buffers for
        # real, so its K/V writes must go to the pad block, not to slot 0 of real block 0.
        self._static = _Static(
            input_ids=torch.zeros(top, dtype=torch.long, device=device),
            positions=torch.zeros(top, dtype=torch.long, device=device),
            slot_mapping=torch.full(
                (top,), pad_block * block_size, dtype=torch.long, device=device
            ),
            query_start_loc=torch.arange(top + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(top, dtype=torch.int32, device=device),
            block_tables=torch.full(
                (top, max_blocks_per_seq), pad_block, dtype=torch.int32, device=device
            ),
        )
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps served by a graph (or the static path)

    @staticmethod
    def supported(device: torch.device, backend_name: str) -> str | None:
        """Why graphs cannot be used here; None if they can."""
        if device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if backend_name not in GRAPH_BACKENDS:
            return f"attention backend {backend_name!r} does host work per step"
        return None

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def can_run(self, batch: ModelInput) -> bool:
        n = len(batch.seq_lens_host)
        return (
            self.bucket(n) is not None
            and all(q == 1 for q in batch.query_lens_host)
            and batch.block_tables.shape[1] <= self.max_blocks
            and batch.logits_indices.shape[0] == n  # one logits row per sequence, in order
        )

    def _metadata(self, size: int, host_lens: tuple[int, ...]) -> AttentionMetadata:
        s = self._static
        return AttentionMetadata(
            query_start_loc=s.query_start_loc[: size + 1],
            seq_lens=s.seq_lens[:size],
            block_tables=s.block_tables[:size],
            slot_mapping=s.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,  # fixes the split-K count
            query_lens_host=(1,) * size,
            seq_lens_host=host_lens,
        )

    def step_on_static(self, size: int) -> torch.Tensor:
        """One step of bucket ``size`` on the static buffers as they stand: what capture
        warms up with (for real, writing K/V) and records."""
        s = self._static
        meta = self._metadata(size, (1,) * size)
        return self._forward(s.input_ids[:size], s.positions[:size], meta)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (later captures reuse its memory pool)."""
        pool = None
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, allocator settles
                for _ in range(2):
                    self.step_on_static(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.step_on_static(size)
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def run(self, batch: ModelInput) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode batch (``can_run`` must be true)."""
        n = len(batch.seq_lens_host)
        size = self.bucket(n)
        assert size is not None and self.can_run(batch)
        s = self._static
        width = batch.block_tables.shape[1]
        s.input_ids[:n].copy_(batch.input_ids)
        s.positions[:n].copy_(batch.positions)
        s.slot_mapping[:n].copy_(batch.slot_mapping)
        s.seq_lens[:n].copy_(batch.seq_lens)
        s.block_tables[:n, :width].copy_(batch.block_tables)
        s.block_tables[:n, width:].fill_(self.pad_block)
        # Padding rows: token 0 at position 0 of the pad block (slot pad_block * block_size).
        s.input_ids[n:size].zero_()
        s.positions[n:size].zero_()
        s.slot_mapping[n:size].fill_(self.pad_block * self.block_size)
        s.seq_lens[n:size].fill_(1)
        s.block_tables[n:size].fill_(self.pad_block)
        self.replays += 1
        if not self.capture:
            host = batch.seq_lens_host + (1,) * (size - n)
            meta = self._metadata(size, host)
            return self._forward(s.input_ids[:size], s.positions[:size], meta)[:n]
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]
