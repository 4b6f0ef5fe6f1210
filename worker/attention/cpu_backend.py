"""``cpu``: the torch backend with decodes served by a native paged kernel (float32).

On the CPU a decode step is memory-bound: the torch reference gathers every decode's whole
context through the block table into a contiguous copy per layer and then reads it again in
``scaled_dot_product_attention`` — three passes over the KV of the batch. The C kernel
(``csrc/paged_decode.c``) reads each K/V row once, in place, through the block table, with the
rows of all kv heads of a token read together (contiguous memory); sequences are split across
the torch thread count by context length. A short chunk on top of a cached prefix (a
speculative verify: a token and its drafts) is served by the same kernel, each new token a
decode row of its own context length, instead of one gather and attention call per sequence.
Prefills keep the torch path: they are GEMM-shaped and already run at BLAS speed there.

Available when the device is the CPU and the kernel builds (a C compiler is present); other
dtypes than float32 fall back to the torch path per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.attention import native
from worker.attention.backend_registry import register_backend
from worker.attention.base import AttentionMetadata
from worker.attention.torch_backend import TorchAttentionBackend, TorchPlan


@dataclass(frozen=True)
class CpuPlan(TorchPlan):
    decode_lens32: torch.Tensor | None = None  # int32 [num_decodes]
    spans: tuple[tuple[int, int], ...] = ()  # work item ranges, a few per thread


@register_backend
class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    decode_chunk = 16  # speculative verify chunks: num_speculative_tokens + 1 at most 33,
    # but an adaptive step drafts far fewer; longer chunks keep the batched prefill path

    @classmethod
    def unavailable_reason(cls, device: torch.device, block_size: int) -> str | None:
        if device.type != "cpu":
            return f"runs on the CPU only, not {device.type}"
        if native.load_kernels() is None:
            return native.unavailable_reason()
        return None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        kernels = native.load_kernels()
        assert kernels is not None, "create_backend checks unavailable_reason first"
        self.kernels = kernels

    def prepare(self, meta: AttentionMetadata) -> CpuPlan:
        plan = super().prepare(meta)
        if plan.decode_rows is None:
            return CpuPlan(**vars(plan))
        lens = plan.decode_lens_host
        return CpuPlan(
            **vars(plan),
            decode_lens32=torch.tensor(lens, dtype=torch.int32, device=meta.seq_lens.device),
            spans=tuple(self.kernels.split(lens)),
        )

    def _decodes(self, q, k_cache, v_cache, prepared: CpuPlan, sliding_window, out) -> None:
        if q.dtype != torch.float32:
            super()._decodes(q, k_cache, v_cache, prepared, sliding_window, out)
            return
        self.kernels.paged_decode(
            q,
            out,
            prepared.decode_rows,
            k_cache,
            v_cache,
            prepared.decode_block_tables,
            prepared.decode_lens32,
            prepared.spans,
            self.scale,
            sliding_window,
        )
