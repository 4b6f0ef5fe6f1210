"""``triton``: paged attention on CUDA with a Triton kernel.

Why not ``vllm-flash-attn`` (what DESIGN.md first planned)
---------------------------------------------------------
* Its last PyPI release, 2.6.2 (Sept 2024), is a binary built against and pinned to
  ``torch==2.4.0``. This project runs ``torch==2.13.0``: installing it would downgrade torch
  (or fail to import with an ABI mismatch), so it cannot be the ``gpu`` extra. That pin is the
  one blocker: the fork's paged (``block_table``) API accepts block sizes in multiples of 16,
  which fits the KV manager's blocks (16 by default).
* Upstream ``flash-attn`` is a source distribution compiled against the local torch (a long
  nvcc build, or a prebuilt wheel fetched from outside the registry at install time), which
  the offline install of this project cannot rely on.
Triton ships with every CUDA build of torch, so a Triton kernel has none of these problems.

What a user choosing a backend must know
----------------------------------------
* ``torch`` (default): CPU or CUDA, any ``block_size``, exact; gathers K/V per step (slow on
  long contexts). The reference for tests.
* ``triton``: CUDA only, needs ``import triton`` to work (``pip install kvcluster[gpu]`` on a
  CPU build of torch); ``block_size`` a power of two in [16, 256]; dtypes float32 (IEEE dot
  products, exact up to summation order), bfloat16, float16. The first call of each shape
  pays a JIT compile (cached on disk by Triton afterwards).
* A ``vllm-flash-attn`` backend could be registered next to these once a release for the
  project's torch exists (``block_size`` a multiple of 16).
"""

from __future__ import annotations

import torch

from worker.attention.backend_registry import register_backend
from worker.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    cuda_unavailable_reason,
    write_kv,
)

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    @classmethod
    def unavailable_reason(cls, device: torch.device, block_size: int) -> str | None:
        reason = cuda_unavailable_reason(device, "triton", "gpu")
        if reason is not None:
            return reason
        power_of_two = block_size & (block_size - 1) == 0
        if not (power_of_two and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE):
            return f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]"
        return None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        from worker.attention.triton_kernel import paged_attention  # lazy: imports triton

        self._kernel = paged_attention

    def forward(self, q, k, v, k_cache, v_cache, prepared: AttentionMetadata, sliding_window=None):
        write_kv(k, v, k_cache, v_cache, prepared.slot_mapping)
        return self._kernel(
            q.contiguous(),
            k_cache,
            v_cache,
            prepared.block_tables,
            prepared.seq_lens,
            prepared.query_start_loc,
            prepared.max_query_len,
            self.scale,
            sliding_window,
            max_seq_len=prepared.max_seq_len,
        )
