"""Building blocks of the Llama family: RMSNorm, rotary embeddings, the gated MLP.

Numerics follow the Hugging Face reference (normalisation in float32, cos/sin computed in
float32 then cast to the activation dtype) so that float32 logits agree to ~1e-6.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused kernel; same formula as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


# A float32 CPU GEMM goes through oneDNN, which reads a plain [out, in] weight once per call,
# from 2 rows when the weight is too large to stay in cache (``ONEDNN_MIN_WEIGHT`` elements,
# 1 MiB) and from ``ONEDNN_MIN_ROWS`` rows otherwise. MKL's sgemm (``F.linear`` for M > 1)
# re-reads a weight to pack it on every call: on SmolLM2-135M (30 layers of 14 MB, a 113 MB
# vocabulary projection) a 2-row decode step cost 2x a 1-row one, and a short multi-token
# verify or prefill chunk as much. Measured there, one thread, linear layers per step (ms,
# rows 1/2/4/8/16): MKL 53/110/93/111/105, oneDNN 54/66/76/91/117 (16 rows: within noise).
# For a cache-resident weight oneDNN's per-call setup costs more than it saves below ~16 rows,
# and one row of any weight stays on MKL's GEMV, which already reads the weight once.
# oneDNN keeps state for every row count it has seen (its primitive cache, per shape): a
# worker whose batches take every row count grew by ~100 KiB per request without bound in
# practice. Row counts are padded to a few sizes (``onednn_rows``): what oneDNN keeps is then
# bounded by the step's token budget.
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN_MIN_ROWS = 16
ONEDNN_MIN_WEIGHT = 1 << 18


def onednn_rows(m: int) -> int:
    """The padded row count oneDNN computes for ``m`` rows: ``m`` rounded up to a multiple
    of the largest power of two at most ``m / 8`` (8 sizes per doubling, at most 1/8 more
    rows beyond 8)."""
    step = 1 << max((m >> 3).bit_length() - 1, 0)
    return -(-m // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through oneDNN for float32 CPU batches of 2 or more rows (see above: the
    same products, summed in another order: results agree to float32 rounding; padding rows
    are zeros, computed and dropped)."""
    if (
        _ONEDNN
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] >= (2 if weight.numel() >= ONEDNN_MIN_WEIGHT else ONEDNN_MIN_ROWS)
        and not torch.is_grad_enabled()
    ):
        m = x.shape[0]
        rows = onednn_rows(m)
        if rows != m:
            x = torch.cat((x, x.new_zeros((rows - m, x.shape[1]))))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:m]
    return F.linear(x, weight, bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without the random init: models are built on the meta device and
    filled from a checkpoint, and ``normal_`` on a meta tensor imports ``torch._dynamo``
    (~2 s of every worker's start on a 2-core machine)."""

    def reset_parameters(self) -> None:
        pass


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedLinear:
    """One GEMM for several ``nn.Linear`` that read the same input (q/k/v, gate/up).

    Allocates one weight (and bias) and re-points each part's parameters at a slice of it, so
    the parts keep their checkpoint names (the loader copies into them, writing the fused
    storage) and no memory is doubled. The output columns are the parts' in order. Built after
    the parameters are allocated (``to_empty`` would give each part storage of its own again).
    """

    def __init__(self, parts: list[nn.Linear]) -> None:
        sizes = [p.out_features for p in parts]
        weight = torch.empty(
            sum(sizes),
            parts[0].in_features,
            dtype=parts[0].weight.dtype,
            device=parts[0].weight.device,
        )
        bias = None if parts[0].bias is None else weight.new_empty(sum(sizes))
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            weight[start : start + size].copy_(part.weight)
            part.weight.data = weight[start : start + size]
            if bias is not None:
                bias[start : start + size].copy_(part.bias)
                part.bias.data = bias[start : start + size]
            start += size
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), act SiLU or tanh-approximated GELU (Gemma's GeGLU); gate
    and up run as one GEMM (``fuse``, by the loader)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        assert act in ("silu", "gelu_pytorch_tanh"), act  # validated in config parsing
        self.act = act
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: FusedLinear | None = None

    def fuse(self) -> None:
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up is not None, "call fuse() once the weights are allocated"
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        gated = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gated.mul_(up))


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32: linear, Llama-3 and YaRN scaling, then
    the per-dimension divisors of a GGUF file's ``rope_freqs.weight``."""
    inv_freq = _scaled_inv_freq(rope, head_dim)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq


def _scaled_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
    assert rope.rope_type == "default", rope.rope_type  # validated in config parsing
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN: dimensions that rotate many times over the original context keep their
    frequency, slow ones are interpolated by ``factor``, a linear ramp blends between."""

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary (non-contiguous) positions of a flat batch."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        # on the CPU even while the model is built on the meta device (``reset_buffers`` puts
        # it on the model's device): arithmetic on meta tensors imports ``torch._dynamo``
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in place (after the module was materialised from meta)."""
        self.inv_freq = rope_inv_freq(self.rope, self.head_dim).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope.attention_factor != 1.0:  # YaRN's attention temperature
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (rotate-half convention).

    ``x * cos + rotate_half(x) * sin`` without materialising ``rotate_half(x)``: each half is
    updated in place with one fused multiply-add, the same products and sums as the reference.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out
