"""Read a GGUF file (llama.cpp's format): the parsed file and this package's ``ModelConfig``.

Torch-free (the router reads the config and tokenizer too); the tokenizer is rebuilt by
``gguf_tokenizer``, the weights are loaded by ``gguf_weights``. Parsed by ``gguf_reader``
(ours: the ``gguf`` package's reader takes tens of seconds on a large vocabulary).
Supported: the ``llama`` architecture (Llama, Mistral, SmolLM, ... as llama.cpp writes them),
``qwen2``, ``qwen3`` and ``gemma3``. Anything else is refused with an error naming what the
file says.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from worker.model.config import ModelConfig, RopeConfig
from worker.model.gguf_reader import GGUFFile, GGUFFormatError, read_gguf
from worker.model.load_errors import ModelLoadError, UnsupportedModelError
from worker.model.rope_config import yarn_mscale

# llama.cpp architecture -> the Hugging Face class it was converted from
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def is_gguf(path: str | Path) -> bool:
    """A model path names a GGUF file (rather than a Hugging Face folder)."""
    return Path(path).suffix.lower() == ".gguf"


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    del mtime_ns, size  # part of the cache key only: a rewritten file is read again
    try:
        return read_gguf(path)
    except GGUFFormatError:
        raise
    except OSError as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file (cached per path and modification time)."""
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{p}: GGUF file not found")
    stat = p.stat()
    return _open(str(p.resolve()), stat.st_mtime_ns, stat.st_size)


class Meta:
    """Typed access to a GGUF file's metadata with errors naming the key and the file."""

    def __init__(self, reader: GGUFFile, source: str) -> None:
        self.reader, self.source = reader, source

    def get(self, key: str, default: Any = None) -> Any:
        return self.reader.fields.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.source}: required metadata key {key!r} is missing")
        return value

    def positive_int(self, key: str, default: Any = None) -> int:
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{self.source}: {key}={value!r} must be a positive integer")
        return value


def interleaves_rotary_rows(arch: str) -> bool:
    """llama.cpp's converter reorders Q/K rows for its interleaved rotary embedding only for
    ``llama`` (Qwen models use its NeoX rotary, which keeps the Hugging Face layout)."""
    return arch == "llama"


def architecture(reader: GGUFFile, source: str) -> str:
    arch = Meta(reader, source).require("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return arch


def config_from_gguf(path: str | Path) -> ModelConfig:
    """The model's architecture from the file's ``llama.*`` metadata and tensor names."""
    reader, source = open_gguf(path), str(path)
    arch = architecture(reader, source)
    meta = Meta(reader, source)
    names = {t.name for t in reader.tensors}
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    if meta.get(key("expert_count"), 0):
        raise UnsupportedModelError(f"{source}: mixture-of-experts GGUF models are not supported")
    hidden = meta.positive_int(key("embedding_length"))
    heads = meta.positive_int(key("attention.head_count"))
    kv_heads = meta.positive_int(key("attention.head_count_kv"), heads)
    head_dim = meta.positive_int(key("attention.key_length"), hidden // heads)
    rope_dim = meta.positive_int(key("rope.dimension_count"), head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"{source}: {key('rope.dimension_count')}={rope_dim} != head_dim={head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    if heads % kv_heads:
        raise ModelLoadError(f"{source}: head_count={heads} is not a multiple of {kv_heads=}")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.positive_int(key("vocab_size"), len(tokens) if tokens else None)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    num_layers = meta.positive_int(key("block_count"))
    fields: dict[str, Any] = dict(
        architecture=SUPPORTED_GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.positive_int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
        rope=_rope(meta, key, source, reader, head_dim),
        max_position_embeddings=meta.positive_int(key("context_length"), 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_windows=(None,) * num_layers,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        torch_dtype=None,
    )
    if arch == "gemma3":
        fields.update(_gemma3(meta, key, num_layers, hidden // heads, head_dim))
    return ModelConfig(**fields)


def _gemma3(meta: Meta, key: Any, num_layers: int, width: int, head_dim: int) -> dict:
    """Gemma 3 as llama.cpp reads it: five sliding-window layers to a global one (unless the
    file gives a pattern), local rope base 10000 (unless ``rope.freq_base_swa``), unscaled;
    queries scaled by head_dim, hidden / heads for the 27B model (62 layers)."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if meta.get(key(name)) is not None:
            raise UnsupportedModelError(f"{meta.source}: {key(name)} is not supported")
    window = meta.get(key("attention.sliding_window"))
    pattern = meta.get(key("attention.sliding_window_pattern"), 6)
    if isinstance(pattern, list):  # per layer: True = sliding window
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(num_layers)]
    if len(sliding) != num_layers:
        raise ModelLoadError(
            f"{meta.source}: {key('attention.sliding_window_pattern')} has {len(sliding)} "
            f"entries, block_count={num_layers}"
        )
    local_theta = float(meta.get(key("rope.freq_base_swa"), 10000.0))
    return dict(
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        sliding_windows=tuple(window if s and window else None for s in sliding),
        local_rope=RopeConfig(theta=local_theta),
        query_pre_attn_scalar=float(width if num_layers == 62 else head_dim),
        qk_norm=True,
    )


def _rope(meta: Meta, key: Any, source: str, reader: GGUFFile, head_dim: int) -> RopeConfig:
    theta = float(meta.get(key("rope.freq_base"), 10000.0))
    scaling = meta.get(key("rope.scaling.type"), "none")
    factors = _freq_factors(reader, source, head_dim)
    if scaling == "none":
        return RopeConfig(theta=theta, freq_factors=factors)
    factor = float(meta.require(key("rope.scaling.factor")))
    if scaling == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor, freq_factors=factors)
    if scaling != "yarn":
        raise UnsupportedModelError(
            f"{source}: rope scaling {scaling!r} is not supported; supported: none, linear, yarn"
        )
    # llama.cpp's defaults: the training context, betas 32 / 1, a temperature of
    # yarn_attn_factor * (1 + 0.1 ln factor), the ramp applied in full (ext_factor < 0 or 1)
    ext = float(meta.get(key("rope.scaling.yarn_ext_factor"), -1.0))
    log_mul = float(meta.get(key("rope.scaling.yarn_log_multiplier"), 0.0))
    if not (ext < 0 or ext == 1.0) or log_mul != 0.0:
        raise UnsupportedModelError(
            f"{source}: yarn with yarn_ext_factor={ext} / yarn_log_multiplier={log_mul} is not "
            "supported (only the defaults: ext_factor 1, no log multiplier)"
        )
    original = meta.get(key("rope.scaling.original_context_length")) or meta.positive_int(
        key("context_length"), 2048
    )
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(meta.get(key("rope.scaling.yarn_beta_fast"), 32.0)),
        beta_slow=float(meta.get(key("rope.scaling.yarn_beta_slow"), 1.0)),
        attention_factor=float(meta.get(key("rope.scaling.yarn_attn_factor"), 1.0))
        * yarn_mscale(factor),
        freq_factors=factors,
    )


def _freq_factors(reader: GGUFFile, source: str, head_dim: int) -> tuple[float, ...] | None:
    """llama.cpp's per-dimension frequency divisors (``rope_freqs.weight``, F32), if any."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    if tensor.tensor_type != GGMLQuantizationType.F32 or int(tensor.n_elements) != head_dim // 2:
        raise ModelLoadError(
            f"{source}: rope_freqs.weight must hold {head_dim // 2} F32 values (head_dim / 2), "
            f"found {int(tensor.n_elements)} of type {tensor.tensor_type.name}"
        )
    values = tuple(float(v) for v in tensor.data)
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ModelLoadError(f"{source}: rope_freqs.weight holds values that are not positive")
    return values
