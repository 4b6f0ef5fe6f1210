"""Write a tiny Hugging Face model folder as a GGUF file the way llama.cpp's converter does
(Q/K rows interleaved for its rotary embedding, tokenizer and chat template as metadata), so
the GGUF loader is tested on small files, including broken and unsupported ones."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import quantize
from safetensors.numpy import load_file

_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


_GEMMA3_NAMES = {
    **_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = _GEMMA3_NAMES if arch == "gemma3" else _NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_rope_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """The per-dimension frequency divisors llama.cpp's converter writes as
    ``rope_freqs.weight`` for Llama-3.1 rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_rope_scaling(w: GGUFWriter, scaling: dict, head_dim: int, theta: float) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":  # no metadata: a tensor of divisors
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(scaling, head_dim, theta))
    elif kind == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif kind == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    else:
        assert kind in (None, "default"), kind


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: QType = QType.F32,
    *,
    arch: str = "llama",
    tensor_types: dict[str, QType] | None = None,
    encode: Callable[[str, np.ndarray], tuple[np.ndarray, QType] | None] | None = None,
) -> Path:
    """``tensor_types``: per GGUF tensor name, a type to store instead of ``qtype`` (as raw,
    zero bytes: for types the loader must refuse). ``encode(gguf_name, data)``: raw bytes
    ``[rows, row_bytes]`` and their type to store instead (None: the default)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w = GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    _add_rope_scaling(w, cfg.get("rope_scaling") or {}, head_dim, cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "gemma3":  # llama.cpp reads only the window; the rest are its Gemma 3 defaults
        w.add_sliding_window(cfg["sliding_window"])
    vocab = tok["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for text, idx in vocab.items():
        tokens[idx] = text
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    for text, idx in special.items():
        tokens[idx] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    if tok_cfg.get("bos_token"):
        w.add_bos_token_id(special[tok_cfg["bos_token"]])
    w.add_eos_token_id(special["</s>"])
    w.add_add_bos_token(bool(tok_cfg.get("bos_token")))
    w.add_chat_template(tok_cfg["chat_template"])
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        data = tensor.astype(np.float32)
        if arch != "llama":  # llama.cpp permutes Q/K for its llama architecture only
            pass
        elif name.endswith("q_proj.weight"):
            data = permute(data, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            data = permute(data, cfg["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # the converter stores Gemma's 1 + weight
        target = gguf_name(name, arch)
        forced = (tensor_types or {}).get(target)
        raw_given = encode(target, data) if encode is not None else None
        if raw_given is not None:
            w.add_tensor(target, raw_given[0], raw_dtype=raw_given[1])
        elif forced is not None:
            from gguf.constants import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[forced]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(target, raw, raw_dtype=forced)
        elif data.ndim == 1 or qtype == QType.F32:
            w.add_tensor(target, data)
        else:
            w.add_tensor(target, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
