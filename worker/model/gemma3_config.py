"""The Gemma 3 traits of a ``config.json`` (``Gemma3ForCausalLM``, ``model_type: gemma3_text``),
and the language model of a ``Gemma3ForConditionalGeneration`` folder (gemma-3 4b and up: its
``text_config``, served text-only).

Gemma 3 interleaves sliding-window layers (their own rope base, ``rope_local_base_freq``,
unscaled) with global layers (``rope_theta`` and ``rope_scaling``), scales queries by
``query_pre_attn_scalar`` and gates its MLP with tanh-approximated GELU. Defaults are
transformers' ``Gemma3TextConfig``'s; the transformers-5 layout (``rope_parameters`` per layer
type) is accepted too. Torch-free, like the rest of the config parsing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.model.load_errors import ModelLoadError, UnsupportedModelError
from worker.model.rope_config import RopeConfig, parse_rope

GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)
SLIDING, FULL = "sliding_attention", "full_attention"
MULTIMODAL = "Gemma3ForConditionalGeneration"
# transformers' Gemma3TextConfig defaults for the keys the Hub's configs may leave out (the
# 4b-27b ``text_config``s give a handful of keys); the rest are defaulted where they are read
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
# top-level keys of a Gemma3Config that win over its text_config's (generation ends at
# <end_of_turn> too: eos [1, 106] on the Hub)
_TOP_LEVEL = ("bos_token_id", "eos_token_id", "torch_dtype", "dtype", "tie_word_embeddings")


def gemma3_text_config(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The ``config.json`` of the language model inside a ``Gemma3ForConditionalGeneration``
    folder, as a ``Gemma3ForCausalLM`` one."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"{source}: text_config={text!r} must be an object")
    kind = text.get("model_type", "gemma3_text")
    if kind != "gemma3_text":
        raise UnsupportedModelError(
            f"{source}: text_config.model_type={kind!r} is not supported (only 'gemma3_text')"
        )
    out = {**text, "architectures": ["Gemma3ForCausalLM"]}
    top = {k: raw[k] for k in _TOP_LEVEL if raw.get(k) is not None}
    if "dtype" in top or "torch_dtype" in top:  # one dtype, the top level's
        out.pop("dtype", None)
        out.pop("torch_dtype", None)
    return {**out, **top}


def gemma3_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Every ``pattern``-th layer global, the others sliding (Gemma 3's 5:1 at pattern 6)."""
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def gemma3_fields(raw: Mapping[str, Any], get: Any, num_layers: int, source: str) -> dict:
    """The ``ModelConfig`` fields Gemma 3 sets differently from the Llama family."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA3_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: hidden_activation={act!r} is not supported (only 'gelu_pytorch_tanh')"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise UnsupportedModelError(f"{source}: {key}={raw[key]!r} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention is not supported")
    window = raw.get("sliding_window", 4096)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{source}: sliding_window={window!r} must be a positive integer")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        layer_types = gemma3_layer_types(num_layers, int(pattern))
    if len(layer_types) != num_layers or not set(layer_types) <= {SLIDING, FULL}:
        raise ModelLoadError(
            f"{source}: layer_types={layer_types!r} must give {num_layers} entries "
            f"({SLIDING!r} or {FULL!r})"
        )
    max_positions = get.integer("max_position_embeddings", default=131072)
    rope, local = _ropes(raw, max_positions, source)
    return dict(
        hidden_act=act,
        rope=rope,
        local_rope=local,
        sliding_windows=tuple(window if t == SLIDING else None for t in layer_types),
        query_pre_attn_scalar=get.number("query_pre_attn_scalar", default=256),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        max_position_embeddings=max_positions,
        qk_norm=True,
        mlp_bias=False,
    )


def _ropes(raw: Mapping[str, Any], max_positions: int, source: str) -> tuple[RopeConfig, ...]:
    """(global, local) rotary embeddings."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and FULL in params:  # transformers 5: one per layer type
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = dict(params or raw.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    return (
        parse_rope(full, 1_000_000.0, max_positions, source),
        parse_rope(local, 10_000.0, max_positions, source),
    )
