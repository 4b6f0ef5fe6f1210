"""``flashinfer``: paged attention on CUDA with FlashInfer (``flashinfer-python``), the
paged-attention library SGLang and vLLM use, on the KV manager's own block tables.

The layout needs no conversion: a layer's ``(k_cache, v_cache)``, each ``[num_blocks,
block_size, num_kv_heads, head_dim]``, is FlashInfer's ``NHD`` paged cache in its tuple form, a
physical block is a FlashInfer page. Per step, :meth:`prepare` keeps the step's metadata; the
first layer turns it into FlashInfer's page lists (:func:`page_lists`: from the host copies of
the lengths, no device sync; the pages gathered from the device block table), and the first
layer of each sliding window plans one ``BatchPrefillWithPagedKVCacheWrapper`` for the step,
which every layer of that window runs. The prefill ("append") kernel serves the whole mixed
batch: FlashInfer's causal mask aligns a request's queries with the end of its context, so a
decode is a query of length 1 there.

What a user choosing it must know:

* CUDA only, with ``pip install flashinfer-python flashinfer-cubin`` (the ``flashinfer``
  extra; the cubin package holds precompiled kernels, without it they compile at first use,
  which needs ``nvcc``);
* float16 or bfloat16 KV caches (FlashInfer has no float32 kernels); any ``block_size``;
* no CUDA graphs of decode steps (its plan is host work per step: ``DecodeGraphs`` runs only
  ``triton`` in graphs), so decode steps run eagerly;
* not ``auto``'s choice: ``triton`` stays the default on CUDA until the two are measured side
  by side on a GPU (``benchmarks/gpu_engine.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from worker.attention.backend_registry import register_backend
from worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    cuda_unavailable_reason,
    write_kv,
)

WORKSPACE_BYTES = 128 << 20  # per planned wrapper: FlashInfer's recommended float workspace
KV_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PageLists:
    """One step's batch in FlashInfer's paged format (host tensors, int32), and where its
    pages sit in the block table."""

    qo_indptr: torch.Tensor  # [num_seqs + 1]: cumulative new tokens
    kv_indptr: torch.Tensor  # [num_seqs + 1]: cumulative pages
    last_page_len: torch.Tensor  # [num_seqs]: tokens in each sequence's last page, 1..block_size
    table_index: torch.Tensor  # int64 [kv_indptr[-1]]: each page's index in block_tables.view(-1)


def page_lists(
    query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_size: int, max_blocks: int
) -> PageLists:
    """The page lists of a batch whose sequence ``i`` has ``seq_lens[i]`` tokens of context,
    its last ``query_lens[i]`` new, in rows of ``max_blocks`` entries of the block table."""
    pages = [(n + block_size - 1) // block_size for n in seq_lens]
    assert all(q <= n for q, n in zip(query_lens, seq_lens, strict=True)), "query past context"
    assert max(pages, default=0) <= max_blocks, "block table shorter than a context"
    kv_indptr = torch.tensor([0, *accumulate(pages)], dtype=torch.int32)
    counts = torch.tensor(pages, dtype=torch.int64)
    starts = torch.arange(len(pages), dtype=torch.int64) * max_blocks
    total = int(kv_indptr[-1])
    offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
        kv_indptr[:-1].long(), counts, output_size=total
    )
    return PageLists(
        qo_indptr=torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32),
        kv_indptr=kv_indptr,
        last_page_len=torch.tensor([(n - 1) % block_size + 1 for n in seq_lens], dtype=torch.int32),
        table_index=torch.repeat_interleave(starts, counts, output_size=total) + offsets,
    )


@dataclass
class FlashInferStep:
    """A step's metadata; its page lists and pages on the device once the first layer has
    seen the caches (their block size); the windows planned for it."""

    meta: AttentionMetadata
    lists: PageLists | None = None
    kv_indices: torch.Tensor | None = None  # int32 [pages], on the caches' device
    planned: set[int] = field(default_factory=set)  # window_left values planned this step

    def pages(self, block_size: int) -> tuple[PageLists, torch.Tensor]:
        """The page lists and the device's page indices, made at the first call of the step."""
        if self.lists is None:
            meta, tables = self.meta, self.meta.block_tables
            self.lists = page_lists(
                meta.query_lens_host, meta.seq_lens_host, block_size, tables.shape[1]
            )
            index = self.lists.table_index
            if tables.device.type == "cuda":
                index = index.pin_memory()
            index = index.to(tables.device, non_blocking=True)
            self.kv_indices = tables.reshape(-1).index_select(0, index).to(torch.int32)
        return self.lists, self.kv_indices


@register_backend
class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    @classmethod
    def unavailable_reason(cls, device: torch.device, block_size: int) -> str | None:
        return cuda_unavailable_reason(device, "flashinfer", "flashinfer")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import flashinfer  # lazy: a CUDA-only dependency

        self._flashinfer = flashinfer
        # one wrapper per sliding window (window_left; -1: none): a plan lives in its
        # wrapper's workspace, so layers of two windows in one step need two
        self._wrappers: dict[int, Any] = {}

    def prepare(self, meta: AttentionMetadata) -> FlashInferStep:
        return FlashInferStep(meta)

    def forward(self, q, k, v, k_cache, v_cache, prepared: FlashInferStep, sliding_window=None):
        if k_cache.dtype not in KV_DTYPES:
            raise ValueError(
                f"attention backend 'flashinfer' needs float16 or bfloat16 KV caches, got "
                f"{k_cache.dtype}: set the model's dtype, or use attention_backend triton or torch"
            )
        write_kv(k, v, k_cache, v_cache, prepared.meta.slot_mapping)
        window_left = -1 if sliding_window is None else sliding_window - 1
        wrapper = self._wrapper(window_left, k_cache.device)
        if window_left not in prepared.planned:
            lists, kv_indices = prepared.pages(k_cache.shape[1])
            wrapper.plan(
                lists.qo_indptr,
                lists.kv_indptr,
                kv_indices,
                lists.last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                k_cache.shape[1],
                causal=True,
                sm_scale=self.scale,
                window_left=window_left,
                q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )
            prepared.planned.add(window_left)
        return wrapper.run(q.contiguous(), (k_cache, v_cache))

    def _wrapper(self, window_left: int, device: torch.device) -> Any:
        wrapper = self._wrappers.get(window_left)
        if wrapper is None:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._wrappers[window_left] = wrapper
        return wrapper
