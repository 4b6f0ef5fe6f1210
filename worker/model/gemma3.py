"""The Gemma 3 decoder (``Gemma3ForCausalLM``: gemma-3-270m, gemma-3-1b, ...) over a flat
token batch, with the Llama family's attention, fused projections and paged KV cache.

What differs from Llama: RMSNorm scales by ``1 + weight`` (in float32, before the cast); each
layer normalises attention and MLP outputs too (sandwich norms: pre/post attention, pre/post
feed-forward) and q and k per head; the MLP is GeGLU (tanh GELU); embeddings are scaled by
sqrt(hidden) in the weights' dtype; sliding-window and global layers interleave, each kind with
its own rotary embedding; attention scores scale by ``query_pre_attn_scalar`` (the backend's
``scale``, ``ModelConfig.attention_scale``). Parameter names mirror transformers', so LoRA
adapters and checkpoints address the same modules as in the Llama family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.attention.base import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.layers import Embedding, GatedMLP, RotaryEmbedding
from worker.model.llama import Attention, KVCache, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight); weights are stored as offsets from 1 (zero-initialised)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend | None) -> None:
        super().__init__(cfg, layer, backend)
        assert cfg.qk_norm
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend | None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(cfg, layer, backend)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.local = cfg.sliding_windows[layer] is not None  # which rotary embedding it uses

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, h, cos, sin, kv, attn):
        h = h + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(h), cos, sin, kv, attn)
        )
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.rotary_emb_local = RotaryEmbedding(cfg.local_rope or cfg.rope, cfg.head_dim)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with Gemma 3's decoder: scaled embeddings, and each layer takes
    the rope of its kind (sliding-window layers the local one)."""

    decoder = Gemma3Model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn: Any,
    ) -> torch.Tensor:
        embed = self.model.embed_tokens
        # sqrt(hidden) rounded to the weights' dtype first, as in the reference (a host
        # scalar: nothing moves to the device, CUDA graphs capture it as a constant)
        scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=embed.weight.dtype))
        h = embed(input_ids) * scale
        ropes = {
            False: self.model.rotary_emb(positions, h.dtype),
            True: self.model.rotary_emb_local(positions, h.dtype),
        }
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, *ropes[layer.local], kv, attn)
        return self.model.norm(h)
