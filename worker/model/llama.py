"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat token batch.

Module and parameter names mirror the Hugging Face checkpoints (``model.layers.N.self_attn.
q_proj.weight`` ...) so ``state_dict()`` names are exactly the tensor names to load.
Attention goes through an ``AttentionBackend`` reading and writing the paged KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.attention.base import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.layers import (
    Embedding,
    FusedLinear,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    linear,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [num_blocks, block_size, kvh, d]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.sliding_window = cfg.sliding_windows[layer]
        self.backend = backend  # None only for shape-only (meta) models
        self.qkv: FusedLinear | None = None

    def fuse(self) -> None:
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, attn: Any
    ) -> torch.Tensor:
        tokens, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        assert self.qkv is not None, "call fuse() once the weights are allocated"
        qkv = self.qkv(x)
        v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
        if self.qk_norm:
            q = self.q_norm(qkv[:, : heads * d].view(tokens, heads, d))
            k = self.k_norm(qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # q and k are adjacent columns: rotate both heads' sets in one pass
            qk = apply_rope(
                qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos, sin
            )
            q, k = qk[:, :heads], qk[:, heads:]
        assert self.backend is not None, "model built without an attention backend"
        out = self.backend.forward(q, k, v, kv[0], kv[1], attn, self.sliding_window)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, h, cos, sin, kv, attn):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states of all new tokens; ``compute_logits`` projects
    only the rows asked for. A family with its own decoder names it in ``decoder``."""

    decoder: type[nn.Module] = DecoderModel

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.decoder(cfg, backend)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def fuse_projections(self) -> None:
        """Run q/k/v and gate/up as one GEMM each (call once weights are allocated; the
        checkpoint names stay, see ``FusedLinear``)."""
        for layer in self.model.layers:
            layer.fuse()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn: Any,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv, attn)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()
