"""The flat batch a model step consumes, and a builder from plain Python lists.

The engine describes each scheduled sequence as a ``SeqChunk`` (its new tokens, how many of
its tokens are already in the KV cache, its block table) and calls ``ModelInput.build``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from worker.attention.base import AttentionMetadata

WantLogits = Literal["last", "all", "none"]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step."""

    token_ids: Sequence[int]  # new tokens to compute this step (prompt chunk, or 1 for decode)
    start_pos: int  # tokens of this sequence already in the KV cache (position of token_ids[0])
    block_table: Sequence[int]  # physical block ids, covering at least start_pos+len(token_ids)
    want_logits: WantLogits = "last"  # "last": next-token logits; "all": every new token; "none"


@dataclass(frozen=True)
class ModelInput:
    """One step's flat batch: sequence i owns rows query_start_loc[i]:query_start_loc[i+1]."""

    input_ids: torch.Tensor  # int64 [num_tokens]: new tokens of all sequences, concatenated
    positions: torch.Tensor  # int64 [num_tokens]: position of each new token in its sequence
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset, K/V write
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length incl. new tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: block tables, padded with 0
    logits_indices: torch.Tensor  # int64 [num_logits]: rows whose next-token logits to return
    query_lens_host: tuple[int, ...]  # host copy: new tokens per sequence
    seq_lens_host: tuple[int, ...]  # host copy of seq_lens

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def attention_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            max_query_len=max(self.query_lens_host, default=0),
            max_seq_len=max(self.seq_lens_host, default=0),
            query_lens_host=self.query_lens_host,
            seq_lens_host=self.seq_lens_host,
        )

    @classmethod
    def build(
        cls, seqs: Sequence[SeqChunk], block_size: int, device: str | torch.device = "cpu"
    ) -> ModelInput:
        """Lay out ``seqs`` flat in the given order.

        The rows of the logits that ``ModelRunner.execute`` returns follow the same order:
        sequence by sequence, one row per sequence for "last", one per new token for "all",
        none for "none" (e.g. a prompt chunk that is not the last one).
        """
        if not seqs:
            raise ValueError("ModelInput.build needs at least one sequence")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits: list[int] = []
        starts = [0]
        for n, seq in enumerate(seqs):
            count = len(seq.token_ids)
            end = seq.start_pos + count
            if count == 0 or seq.start_pos < 0:
                raise ValueError(f"sequence {n}: needs >= 1 new token and start_pos >= 0")
            if len(seq.block_table) * block_size < end:
                raise ValueError(
                    f"sequence {n}: block table of {len(seq.block_table)} blocks holds "
                    f"{len(seq.block_table) * block_size} tokens, needs {end}"
                )
            row = starts[-1]
            ids.extend(seq.token_ids)
            for pos in range(seq.start_pos, end):
                positions.append(pos)
                slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
            if seq.want_logits == "last":
                logits.append(row + count - 1)
            elif seq.want_logits == "all":
                logits.extend(range(row, row + count))
            elif seq.want_logits != "none":
                raise ValueError(f"sequence {n}: want_logits={seq.want_logits!r}")
            starts.append(row + count)
        width = max(len(s.block_table) for s in seqs)
        tables = [list(s.block_table) + [0] * (width - len(s.block_table)) for s in seqs]
        seq_lens = [s.start_pos + len(s.token_ids) for s in seqs]

        parts = (ids, positions, slots, logits, starts, seq_lens, [b for t in tables for b in t])
        return cls.from_host(
            torch.tensor([v for part in parts for v in part], dtype=torch.long),
            [len(part) for part in parts],
            (len(seqs), width),
            device,
            tuple(len(s.token_ids) for s in seqs),
            tuple(seq_lens),
        )

    @classmethod
    def from_host(
        cls,
        host: torch.Tensor,
        lengths: Sequence[int],
        table_shape: tuple[int, int],
        device: torch.device | str,
        query_lens: tuple[int, ...],
        seq_lens: tuple[int, ...],
    ) -> ModelInput:
        """The step's input from one int64 host buffer holding, in order, the token ids,
        positions, slots, logits rows, query starts, sequence lengths and block tables
        (``lengths`` of each): pinned on CUDA, one non-blocking copy, the fields its views."""
        device = torch.device(device)
        if device.type == "cuda":
            host = host.pin_memory()
        views = host.to(device, non_blocking=True).split(list(lengths))
        return cls(
            input_ids=views[0],
            positions=views[1],
            slot_mapping=views[2],
            logits_indices=views[3],
            query_start_loc=views[4].to(torch.int32),
            seq_lens=views[5].to(torch.int32),
            block_tables=views[6].view(*table_shape).to(torch.int32),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
