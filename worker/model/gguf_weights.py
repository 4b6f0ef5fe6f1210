"""Copy a GGUF file's tensors into a ``LlamaForCausalLM``: llama.cpp names mapped to Hugging
Face names, quantized blocks dequantized (``gguf.quants``, float32) into the model's dtype, and
llama.cpp's interleaving of Q/K rows for its rotary embedding undone.

Every tensor is checked (known name, known type, right shape) before any is copied.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize
from torch import nn

from worker.model.config import ModelConfig
from worker.model.gguf_file import architecture, interleaves_rotary_rows, open_gguf
from worker.model.gguf_reader import TensorInfo
from worker.model.load_errors import UnsupportedModelError, WeightMismatchError

SUPPORTED_QUANT_TYPES = tuple(
    QType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    + ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's four norms per layer (llama.cpp calls its pre-feed-forward norm ``ffn_norm``)
_GEMMA3_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors read into the config rather than the model (the rope frequency divisors).
_CONFIG_TENSORS = ("rope_freqs.weight",)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor (None for one this model does not use)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    layer = _GEMMA3_LAYER if arch == "gemma3" else _LAYER
    match = _BLOCK.fullmatch(gguf_name)
    if match is None or match[2] not in layer:
        return None
    return f"model.layers.{match[1]}.{layer[match[2]]}.{match[3]}"


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert step, which reorders each head's Q/K rows from the Hugging Face
    rotate-half layout (x[:d/2], x[d/2:]) to interleaved pairs (x0, x1), (x2, x3), ..."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def read_tensor(tensor: TensorInfo, source: str) -> np.ndarray:
    """Float32 array in the Hugging Face (row-major, [out, in]) shape."""
    qtype = QType(tensor.tensor_type)
    if qtype not in SUPPORTED_QUANT_TYPES:
        raise UnsupportedModelError(
            f"{source}: tensor {tensor.name} has quantization type {qtype.name}, which is not "
            f"supported; supported: {', '.join(q.name for q in SUPPORTED_QUANT_TYPES)}"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    if qtype == QType.F32:
        data = np.asarray(tensor.data, dtype=np.float32)
    else:
        data = dequantize(np.asarray(tensor.data), qtype).astype(np.float32, copy=False)
    return data.reshape(shape)


def load_gguf_weights(model: nn.Module, path: str | Path, cfg: ModelConfig) -> None:
    """Copy the file's tensors into ``model``'s parameters (converting dtype, moving device)."""
    reader, source = open_gguf(path), str(path)
    arch = architecture(reader, source)
    interleaved = interleaves_rotary_rows(arch)
    # llama.cpp's converter stores Gemma's norm weights as 1 + weight (its RMSNorm multiplies)
    norm_offset = 1.0 if arch == "gemma3" else 0.0
    params = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in params.items()}
    found: dict[str, TensorInfo] = {}
    unused = []
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name, arch)
        if name is None or name not in expected:
            unused.append(tensor.name)
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if shape != expected[name]:
            raise WeightMismatchError(
                f"{source}: tensor {tensor.name} ({name}) has shape {list(shape)}, expected "
                f"{list(expected[name])} from the file's metadata"
            )
        if QType(tensor.tensor_type) not in SUPPORTED_QUANT_TYPES:
            read_tensor(tensor, source)  # raises the error naming the type, before any copy
        found[name] = tensor
    if unused:
        raise WeightMismatchError(
            f"{source}: {len(unused)} tensors this architecture does not use: "
            f"{', '.join(unused[:5])}"
        )
    missing = sorted(set(expected) - set(found))
    if missing:
        raise WeightMismatchError(
            f"{source}: the file lacks {len(missing)} expected tensors: {', '.join(missing[:5])}"
        )
    with torch.no_grad():
        for name, tensor in found.items():
            data = read_tensor(tensor, source)
            if interleaved and ".q_proj." in name:
                data = unpermute_rotary(data, cfg.num_heads)
            elif interleaved and ".k_proj." in name:
                data = unpermute_rotary(data, cfg.num_kv_heads)
            elif norm_offset and name.endswith("norm.weight"):
                data = data - norm_offset
            if not data.flags.writeable:  # an F32 tensor is a view of the read-only map
                data = data.copy()
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(data)))
