"""Parse a Hugging Face ``config.json`` of a Llama-family model into a frozen ``ModelConfig``.

Only what the runner needs is kept, and everything is validated here so the model code can
trust it. Both the legacy layout (``rope_theta`` + ``rope_scaling``, as on the Hub) and the
transformers-5 layout (``rope_parameters``) are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from worker.model.load_errors import ModelLoadError, UnsupportedModelError
from worker.model.rope_config import SUPPORTED_ROPE_TYPES, RopeConfig, parse_rope

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelConfig", "RopeConfig"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
_REQUIRED = object()  # marks a config key without a default


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of one Llama-family checkpoint, validated."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int  # rows of the embedding / lm_head
    hidden_size: int  # residual stream width
    intermediate_size: int  # MLP width
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: divides num_heads)
    head_dim: int  # per-head width (may differ from hidden_size // num_heads, e.g. Qwen3)
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope: RopeConfig  # rotary embedding parameters
    max_position_embeddings: int  # longest context the checkpoint declares
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # q/k/v projections have a bias (Qwen2: always)
    o_bias: bool  # output projection has a bias
    mlp_bias: bool  # gate/up/down projections have a bias
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...]  # per layer: attention window, None = full
    bos_token_id: int | None  # beginning-of-sequence id declared by the config
    eos_token_ids: tuple[int, ...]  # end-of-sequence ids declared by the config
    torch_dtype: str | None  # dtype the checkpoint declares ("bfloat16", ...), informational
    hidden_act: str = "silu"  # MLP gate activation: "silu", or "gelu_pytorch_tanh" (Gemma 3)
    query_pre_attn_scalar: float | None = None  # scores scale by its inverse root; None: head_dim
    local_rope: RopeConfig | None = None  # rope of the sliding-window layers if theirs (Gemma 3)
    # the folder's multimodal class when only its language model is served (its weights are
    # under ``language_model.``): "Gemma3ForConditionalGeneration"; None for a causal LM
    multimodal: str | None = None

    @property
    def attention_scale(self) -> float:
        """The factor of q.k in attention (1/sqrt(head_dim) unless the checkpoint says)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary embedding of one layer (sliding-window layers may have their own)."""
        if self.local_rope is not None and self.sliding_windows[layer] is not None:
            return self.local_rope
        return self.rope

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """From a Hugging Face folder's config.json, or from a ``.gguf`` file's metadata."""
        if str(model_dir).lower().endswith(".gguf"):
            from worker.model.gguf_file import config_from_gguf

            return config_from_gguf(model_dir)
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path} not found: a model folder needs config.json (Hugging Face format)"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        return _parse(raw, source)


def _parse(raw: Mapping[str, Any], source: str) -> ModelConfig:
    from worker.model.gemma3_config import GEMMA3_TEXT_DEFAULTS, MULTIMODAL, gemma3_text_config

    if raw.get("architectures") == [MULTIMODAL]:
        text = gemma3_text_config(raw, source)
        return replace(_parse(text, f"{source} text_config"), multimodal=MULTIMODAL)
    arch = _architecture(raw, source)
    if arch == "Gemma3ForCausalLM":  # as transformers' Gemma3TextConfig reads it
        raw = {**GEMMA3_TEXT_DEFAULTS, **raw}
    get = _Getter(raw, source)
    hidden = get.integer("hidden_size")
    num_heads = get.integer("num_attention_heads")
    num_kv_heads = get.integer("num_key_value_heads", default=num_heads)
    gemma = arch == "Gemma3ForCausalLM"
    head_dim = get.integer("head_dim", default=None) or (256 if gemma else hidden // num_heads)
    num_layers = get.integer("num_hidden_layers")
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=get.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get.integer("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get.number("rms_norm_eps", default=1e-6),
        max_position_embeddings=get.integer("max_position_embeddings", default=2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if arch == "LlamaForCausalLM" else False,
        qk_norm=arch == "Qwen3ForCausalLM",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_id_tuple(raw.get("eos_token_id")),
        torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
    )
    if gemma:
        from worker.model.gemma3_config import gemma3_fields

        fields.update(gemma3_fields(raw, get, num_layers, source))
    else:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act={act!r} is not supported (only 'silu')"
            )
        fields.update(
            rope=_rope(raw, get, source),
            sliding_windows=_sliding_windows(raw, arch, num_layers, source),
        )
    return ModelConfig(**fields)


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: unsupported architectures={archs!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}, and Gemma3ForConditionalGeneration "
            "(its language model, text only)"
        )
    return archs[0]


def _rope(raw: Mapping[str, Any], get: _Getter, source: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor != 1 is not supported")
    max_positions = get.integer("max_position_embeddings", default=2048)
    return parse_rope(params, float(raw.get("rope_theta", 10000.0)), max_positions, source)


def _sliding_windows(
    raw: Mapping[str, Any], arch: str, num_layers: int, source: str
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window"):
        window = None
    if window is None:
        return (None,) * num_layers
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive integer")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(raw.get("max_window_layers", 0)) if arch != "MistralForCausalLM" else 0
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ModelLoadError(
            f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers={num_layers}"
        )
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


class _Getter:
    """Typed access to config keys with messages that name the key and the file."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def _value(self, key: str, default: Any) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.source}: required key {key!r} is missing")
        return default

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{self.source}: {key}={value!r} must be a positive integer")
        return value

    def number(self, key: str, default: float) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"{self.source}: {key}={value!r} must be a positive number")
        return float(value)
