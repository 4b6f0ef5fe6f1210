"""The attention-backend interface and the per-step metadata of a flat mixed batch.

A step's new tokens are laid out flat: sequence ``i`` owns rows
``query_start_loc[i]:query_start_loc[i+1]`` of ``q``/``k``/``v``. Its new tokens are the
*last* ``query_len`` tokens of its context, so token ``j`` of sequence ``i`` sits at position
``seq_lens[i] - query_len_i + j``. Prefills, prefill chunks on top of a cached prefix and
decodes (``query_len == 1``) mix freely in one batch.

The paged KV cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (K and V). Logical block ``b`` of sequence ``i`` lives in physical block
``block_tables[i, b]``; a token at position ``p`` occupies slot
``block_tables[i, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's new tokens go in the paged cache and what each one attends to."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cu_seqlens of new tokens per sequence
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length incl. the new tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: physical block ids, padded
    slot_mapping: torch.Tensor  # int64 [num_tokens]: physical slot where each new token's K/V go
    max_query_len: int  # max new tokens of one sequence in this step
    max_seq_len: int  # max context length of one sequence in this step
    query_lens_host: tuple[int, ...]  # host copy of new tokens per sequence (no device sync)
    seq_lens_host: tuple[int, ...]  # host copy of seq_lens

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V [num_tokens, kv_heads, head_dim] into their slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def cuda_unavailable_reason(device: torch.device, package: str, extra: str) -> str | None:
    """Why a CUDA backend built on ``package`` (installed by kvcluster's ``extra``) cannot run
    on ``device``; None if it can, as far as those go."""
    if device.type != "cuda":
        return "needs a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available in this torch build or machine"
    if importlib.util.find_spec(package) is None:
        return f"the {package!r} package is not installed (pip install kvcluster[{extra}])"
    return None


class AttentionBackend(ABC):
    """Paged attention over a flat mixed batch.

    One instance serves all layers of one model runner. Per step the runner calls
    ``prepare(metadata)`` once and passes the result to ``forward`` of every layer.

    Caller's obligations:
      * ``q`` is ``[num_tokens, num_heads, head_dim]``, ``k``/``v`` are
        ``[num_tokens, num_kv_heads, head_dim]``, rows ordered by ``query_start_loc``, with the
        dtype and device of the caches; RoPE is already applied.
      * ``block_tables`` covers every sequence's ``seq_lens`` tokens, and blocks that hold the
        cached prefix already contain its K/V (copy-on-write copies are done before the step).
      * The slots in ``slot_mapping`` are distinct and not read by another sequence as prefix.
    Backend's obligations:
      * write the new K/V into the caches at ``slot_mapping`` before attending (so a token sees
        itself and the tokens of its own chunk);
      * attend causally: a token at position ``p`` sees positions ``0..p`` of its sequence
        (within ``sliding_window`` if given: positions ``> p - sliding_window``);
      * return ``[num_tokens, num_heads, head_dim]`` in ``q``'s dtype, never read past
        ``seq_lens`` (padding entries of ``block_tables`` are arbitrary).
    """

    name: ClassVar[str]

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @classmethod
    def unavailable_reason(cls, device: torch.device, block_size: int) -> str | None:
        """Why this backend cannot run on ``device`` with ``block_size``; None if it can."""
        return None

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-step precomputation shared by all layers; the default passes ``meta`` on."""
        return meta

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prepared: Any,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write k/v into the caches, attend, return ``[num_tokens, num_heads, head_dim]``."""
