"""Rotary position embedding parameters, parsed from a Hugging Face ``config.json``.

Torch-free (the router reads model configs). The frequencies themselves are computed by
``worker.model.layers.rope_inv_freq``. Both the legacy layout (``rope_theta`` +
``rope_scaling``) and the transformers-5 layout (``rope_parameters``, per layer type for
models with two rotary embeddings) are accepted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.model.load_errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding parameters."""

    theta: float  # base wavelength (``rope_theta``)
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear / llama3 / yarn: context extension factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 / yarn: pre-training context
    beta_fast: float = 32.0  # yarn: rotations above which a dimension is extrapolated
    beta_slow: float = 1.0  # yarn: rotations below which a dimension is interpolated
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float = 1.0  # yarn: cos/sin are multiplied by this
    # Per-dimension divisors of the frequencies (llama.cpp's ``rope_freqs.weight``: how its
    # converter writes Llama-3.1 scaling); applied after the type's own scaling.
    freq_factors: tuple[float, ...] | None = None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context extension ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def parse_rope(
    params: Mapping[str, Any], default_theta: float, max_positions: int, source: str
) -> RopeConfig:
    """One rotary embedding's parameters (a ``rope_scaling`` / ``rope_parameters`` dict)."""
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = _positive(params, "factor", None, source)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    if rope_type == "yarn":
        return _yarn(params, theta, factor, max_positions, source)
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or max_positions
        ),
    )


def _yarn(
    params: Mapping[str, Any], theta: float, factor: float, max_positions: int, source: str
) -> RopeConfig:
    attention = params.get("attention_factor")
    if attention is None:  # as transformers infers it
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or max_positions
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention),
    )


def _positive(params: Mapping[str, Any], key: str, default: Any, source: str) -> float:
    value = params.get(key, default)
    if value is None:
        raise ModelLoadError(f"{source}: rope scaling lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ModelLoadError(f"{source}: rope scaling {key}={value!r} must be a positive number")
    return float(value)
