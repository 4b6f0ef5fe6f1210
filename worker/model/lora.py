"""LoRA adapters in the PEFT format: read, check against the base model, give a stable id.

A PEFT adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``
...) and ``adapter_model.safetensors`` (or peft's older ``adapter_model.bin``, a pickle read
with ``torch.load(weights_only=True)``: tensors only, never code) with, per adapted
projection, ``...layers.N.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``. The delta of a
projection is ``x @ A.T @ B.T * scaling`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA). The scaling is folded into B here, once, so serving never multiplies by it.
What the config means (and which of its keys are refused) is ``lora_config``'s; this module
reads the weights, refusing any that are not finite or whose folded scaling overflows.

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

from kvstore.adapter_registry import ADAPTER_NAME, ADAPTER_NAME_RULE
from worker.model.config import ModelConfig
from worker.model.lora_config import (
    MODULES,
    AdapterConfig,
    AdapterConfigError,
    parse_adapter_config,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"  # peft's save_pretrained(safe_serialization=False)
_KEY = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)

# every projection's output reaches an RMSNorm, which squares it in float32: a delta that can
# grow a unit-size input past sqrt(float32 max) overflows there
_GAIN_LIMIT = math.sqrt(torch.finfo(torch.float32).max)


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
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise LoraError(f"adapter name {name!r} is invalid: {ADAPTER_NAME_RULE}")
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


def _read_config(
    name: str, path: Path, raw: bytes, cfg: ModelConfig, max_rank: int
) -> AdapterConfig:
    try:
        acfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoraError(f"adapter {name!r}: {path} is not JSON: {exc}") from None
    try:
        return parse_adapter_config(acfg, cfg, max_rank)
    except AdapterConfigError as exc:
        raise LoraError(f"adapter {name!r}: {path}: {exc}") from None


def _weights_path(name: str, folder: Path) -> Path:
    """The weights file: safetensors when both are there (as peft prefers it)."""
    for file in (WEIGHTS_FILE, PICKLE_WEIGHTS_FILE):
        if (folder / file).is_file():
            return folder / file
    raise LoraError(
        f"adapter {name!r}: {folder / WEIGHTS_FILE} not found (a PEFT adapter folder needs "
        f"{CONFIG_FILE} and {WEIGHTS_FILE} or {PICKLE_WEIGHTS_FILE})"
    )


def _load_safetensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own and OS errors alike
        raise LoraError(
            f"adapter {name!r}: {path} is not a readable safetensors file: {exc}"
        ) from None


def _load_pickle(name: str, path: Path) -> dict[str, torch.Tensor]:
    """peft's ``torch.save`` of the state dict. ``weights_only`` unpickles tensors, dicts and
    plain values only (any other object, and so any code, is refused); what it returns must
    then be a dict of tensors, as peft saves it."""
    try:
        tensors = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, zip/EOF and OS errors alike
        raise LoraError(
            f"adapter {name!r}: {path} is not a PyTorch weights file that can be loaded safely "
            f"(only tensors are unpickled, never other objects): {_reason(exc)}"
        ) from None
    if not isinstance(tensors, dict):
        raise LoraError(
            f"adapter {name!r}: {path} holds a {type(tensors).__name__}, not a dict of tensors"
        )
    for key, t in tensors.items():
        if not isinstance(key, str) or not isinstance(t, torch.Tensor):
            raise LoraError(
                f"adapter {name!r}: {path}: entry {key!r} is a {type(t).__name__}, not a tensor"
            )
    return tensors


def _reason(exc: Exception) -> str:
    """The line of torch's refusal that names the object (its message is a page of advice,
    including how to load the file unsafely)."""
    text = str(exc)
    if "WeightsUnpickler error: " in text:
        text = text.split("WeightsUnpickler error: ", 1)[1].split(". ", 1)[0]
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    if path.stat().st_size == 0:
        raise LoraError(f"adapter {name!r}: {path} is empty (a weights file is expected)")
    if path.name == PICKLE_WEIGHTS_FILE:
        tensors = _load_pickle(name, path)
    else:
        tensors = _load_safetensors(name, path)
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise LoraError(f"adapter {name!r}: {path}: tensor {key!r} has dtype {t.dtype}")
        if not torch.isfinite(t).all():
            raise LoraError(
                f"adapter {name!r}: {path}: tensor {key!r} holds NaN or infinite values"
            )
    return tensors


def load_adapter(
    name: str,
    path: str | Path,
    cfg: ModelConfig,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Read and check a PEFT adapter folder for a model computing in ``dtype``; raises
    :class:`LoraError` naming the adapter, the file and what is wrong."""
    check_name(name)
    if cfg.multimodal is not None:  # peft's paths there name the vision tower's layers too
        raise LoraError(
            f"adapter {name!r}: LoRA adapters are not served on the language model of a "
            f"{cfg.multimodal} folder; serve them on its Gemma3ForCausalLM form"
        )
    folder = Path(path)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoraError(
            f"adapter {name!r}: {cfg_path} not found (a PEFT adapter folder needs "
            f"{CONFIG_FILE} and {WEIGHTS_FILE} or {PICKLE_WEIGHTS_FILE})"
        )
    w_path = _weights_path(name, folder)
    raw_cfg = cfg_path.read_bytes()
    acfg = _read_config(name, cfg_path, raw_cfg, cfg, max_rank)
    rank, scaling = acfg.rank, acfg.scaling
    tensors = _read_tensors(name, w_path)
    dims = _module_dims(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in dims:
            raise LoraError(
                f"adapter {name!r}: {w_path}: tensor {key!r} is not a LoRA weight of "
                f"{list(MODULES)}"
            )
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(
                f"adapter {name!r}: {w_path}: {key!r} names layer {layer}; the model has "
                f"{cfg.num_layers}"
            )
        if (layer, m.group(2)) not in acfg.targets:
            raise LoraError(
                f"adapter {name!r}: {w_path}: {key!r} adapts a module that {CONFIG_FILE}'s "
                "target_modules / exclude_modules / layers_to_transform do not select"
            )
        parts.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    weights = {}
    dtype_max = torch.finfo(dtype).max
    gain_limit = min(_GAIN_LIMIT, dtype_max)
    for (layer, mod), ab in sorted(parts.items()):
        fan_in, fan_out = dims[mod]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise LoraError(
                f"adapter {name!r}: {w_path}: layer {layer} {mod} lacks lora_A or lora_B"
            )
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraError(
                f"adapter {name!r}: {w_path}: layer {layer} {mod} has A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}; this model needs A ({rank}, {fan_in}), B ({fan_out}, {rank})"
            )
        folded = b.double() * scaling
        # an upper bound of |delta|_inf for inputs of |x|_inf <= 1: |B'| @ (row sums of |A|)
        gain = float((folded.abs() @ a.double().abs().sum(1)).max())
        if not (float(folded.abs().max()) <= dtype_max and gain <= gain_limit):
            raise LoraError(
                f"adapter {name!r}: lora_alpha={acfg.alpha:g} (scaling {scaling:g}) with "
                f"layer {layer} {mod}'s weights in {w_path} can grow an input of size 1 to "
                f"{gain:.3g}; at most {gain_limit:.3g} can be served in {dtype} (every "
                "projection feeds an RMSNorm, which squares its input in float32)"
            )
        weights[(layer, mod)] = (a.float().contiguous(), folded.float().contiguous())
    if not weights:
        raise LoraError(f"adapter {name!r}: {w_path} holds no LoRA weights")
    digest = hashlib.blake2b(raw_cfg + w_path.read_bytes(), digest_size=8).hexdigest()
    return LoraAdapter(name, f"{name}@{digest}", rank, scaling, weights)
