"""LoRA adapters in the PEFT format: read, check against the base model, give a stable id.

A PEFT adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``
...) and ``adapter_model.safetensors`` with, per adapted projection, ``...layers.N.self_attn.
q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``. The delta of a
projection is ``x @ A.T @ B.T * scaling`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA). The scaling is folded into B here, once, so serving never multiplies by it.

The adapter id names the adapter's *contents* (name plus a digest of its config and weights),
not its folder: the same adapter under the same name on two workers has one id (so the
router's block keys match both), and a changed adapter re-registered under an old name gets
a new id (so KV computed with the old weights is never served for the new ones).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class LoraError(ValueError):
    """An adapter that cannot be served on this model; the message names the field and fix."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the host, ready to be copied into a slot."""

    name: str  # what requests ask for (``lora`` field)
    adapter_id: str  # stable id folded into block keys: ``name@digest``
    rank: int  # r
    scaling: float  # lora_alpha / r (already folded into ``weights``' B)
    # (layer, module) -> (A [r, in], B [out, r] * scaling), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise LoraError(
            f"adapter name {name!r} is invalid: 1-64 characters of letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return name


def _module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT adapter folder; raises :class:`LoraError` naming what is wrong."""
    from safetensors.torch import load_file

    check_name(name)
    folder = Path(path)
    cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise LoraError(
                f"adapter {name!r}: {p} not found (a PEFT adapter folder needs "
                f"{CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    raw_cfg = cfg_path.read_bytes()
    try:
        acfg = json.loads(raw_cfg)
    except json.JSONDecodeError as exc:
        raise LoraError(f"adapter {name!r}: {cfg_path} is not JSON: {exc}") from None
    rank, alpha = acfg.get("r"), acfg.get("lora_alpha", acfg.get("r"))
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise LoraError(
            f"adapter {name!r}: r={rank!r} must be an integer in [1, "
            f"max_lora_rank={max_rank}] (raise max_lora_rank)"
        )
    unsupported = {
        "use_dora": bool(acfg.get("use_dora")),
        "bias": acfg.get("bias", "none") != "none",
        "modules_to_save": bool(acfg.get("modules_to_save")),
        "rank_pattern": bool(acfg.get("rank_pattern")),
        "alpha_pattern": bool(acfg.get("alpha_pattern")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise LoraError(f"adapter {name!r}: {', '.join(bad)} not supported (plain LoRA only)")
    scaling = alpha / math.sqrt(rank) if acfg.get("use_rslora") else alpha / rank
    targets = acfg.get("target_modules")
    if isinstance(targets, list):
        other = sorted(set(targets) - set(MODULES))
        if other:
            raise LoraError(
                f"adapter {name!r}: target_modules {other} not supported; valid: {list(MODULES)}"
            )
    tensors = load_file(str(w_path))
    dims = _module_dims(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in dims:
            raise LoraError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA weight of {list(MODULES)}"
            )
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(
                f"adapter {name!r}: {key!r} names layer {layer}; the model has {cfg.num_layers}"
            )
        parts.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    weights = {}
    for (layer, mod), ab in sorted(parts.items()):
        fan_in, fan_out = dims[mod]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise LoraError(f"adapter {name!r}: layer {layer} {mod} lacks lora_A or lora_B")
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraError(
                f"adapter {name!r}: layer {layer} {mod} has A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}; this model needs A ({rank}, {fan_in}), B ({fan_out}, {rank})"
            )
        weights[(layer, mod)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    if not weights:
        raise LoraError(f"adapter {name!r}: {w_path} holds no LoRA weights")
    digest = hashlib.blake2b(raw_cfg + w_path.read_bytes(), digest_size=8).hexdigest()
    return LoraAdapter(name, f"{name}@{digest}", rank, scaling, weights)
