"""``adapter_config.json`` of a PEFT LoRA adapter: an allow-list, and target matching as peft.

Every key peft writes is either understood and honoured (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ``exclude_modules``, ``layers_to_transform``,
``layers_pattern``), informational (names, versions, training-only settings such as
``lora_dropout``), or a feature this server does not implement, accepted only at its no-op
default (``use_dora: false``, ``alora_invocation_tokens: null`` ...). Anything else, and any
key peft does not write, is refused by name: an adapter is served exactly as peft runs it, or
not at all.

Targets are matched against the module paths of the Hugging Face model
(``model.layers.3.self_attn.q_proj``) with peft's rules: a list entry matches a path equal to
it or ending in ``.entry``; a string is a regex that must match the whole path, or
``"all-linear"`` (every projection, never ``lm_head``); ``exclude_modules`` (list or regex)
wins over targets; ``layers_to_transform`` / ``layers_pattern`` keep list targets to the
given layer indices.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from worker.model.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# peft's own defaults for a LoraConfig without these keys
PEFT_DEFAULT_R, PEFT_DEFAULT_ALPHA = 8, 8
DEFAULT_MAX_LORAS = 4  # adapter slots on the device (workers.engine.max_loras)
DEFAULT_MAX_LORA_RANK = 16  # largest rank a slot holds (workers.engine.max_lora_rank)
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's mapping for Llama, Mistral, Qwen2/3
ALL_LINEAR = "all-linear"


class AdapterConfigError(ValueError):
    """A config key this server cannot honour; ``load_adapter`` adds adapter and file."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What serving an adapter needs from its config."""

    rank: int  # r
    alpha: float  # lora_alpha
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    targets: frozenset[tuple[int, str]]  # (layer, projection) pairs the adapter adapts


def _is_null(v: Any) -> bool:
    return v is None


def _is_empty(v: Any) -> bool:
    return v is None or v in ({}, [], "")


def _any(v: Any) -> bool:
    return True


def _is_false(v: Any) -> bool:
    return v is None or v is False


# key -> predicate of the values that change nothing (the feature is off); the key is refused
# when the value fails it. Honoured keys are parsed in ``parse_adapter_config``.
_NO_OP: dict[str, Callable[[Any], bool]] = {
    # names, versions and bookkeeping
    "task_type": lambda v: v in (None, "CAUSAL_LM"),
    "auto_mapping": _any,
    "peft_version": _any,
    "base_model_name_or_path": _any,
    "revision": _any,
    "inference_mode": _any,
    "runtime_config": _any,
    # training-only: no effect when the adapter runs
    "lora_dropout": _any,
    "megatron_core": _any,
    "qalora_group_size": _any,
    "ensure_weight_tying": _any,  # ties adapters of tied embeddings, which are not targeted
    "fan_in_fan_out": _any,  # peft forces it off for nn.Linear, the only layers targeted
    # True / False / "gaussian" only initialise A and B (loading overwrites them); the others
    # (pissa, olora, corda, loftq, eva ...) also rewrite the base weights when loading
    "init_lora_weights": lambda v: v is True or v is False or v == "gaussian",
    # settings of those other inits, which peft ignores under the plain ones
    "loftq_config": _any,
    "eva_config": _any,
    "corda_config": _any,
    "lora_ga_config": _any,
    # features that are not implemented: accepted only when off
    "bias": lambda v: v in (None, "none"),
    "lora_bias": _is_false,
    "use_dora": _is_false,
    "use_qalora": _is_false,
    "modules_to_save": _is_empty,
    "rank_pattern": _is_empty,
    "alpha_pattern": _is_empty,
    "megatron_config": _is_null,
    "trainable_token_indices": _is_empty,
    "velora_config": _is_null,
    "alora_invocation_tokens": _is_null,
    "monteclora_config": _is_null,
    "layer_replication": _is_null,
    "target_parameters": _is_empty,
    "use_bdlora": _is_false,
    "arrow_config": _is_null,
    "kasa_config": _is_null,
    # written by early peft releases (alpaca-lora era adapters); current peft drops them
    "enable_lora": _is_null,  # per-slice LoRA of a fused qkv module
    "merge_weights": _any,  # merge into the base weights for eval: the same outputs
}
_HONOURED = (
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
)


def _number(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise AdapterConfigError(f"{key}={v!r} must be a number")
    if not math.isfinite(v):
        raise AdapterConfigError(f"{key}={v!r} must be a finite number")
    return float(v)


def _names(key: str, v: Any) -> list[str] | str | None:
    """A list of module names or a regex string, as peft accepts for target/exclude."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    raise AdapterConfigError(f"{key}={v!r} must be a list of module names or a regex string")


def _regex(key: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise AdapterConfigError(f"{key}={pattern!r} is not a valid regex: {exc}") from None


def module_paths(cfg: ModelConfig) -> Iterator[tuple[int, str, str]]:
    """(layer, projection, Hugging Face module path) of every adaptable projection."""
    for layer in range(cfg.num_layers):
        for mod in MODULES:
            part = "self_attn" if mod in _ATTN else "mlp"
            yield layer, mod, f"model.layers.{layer}.{part}.{mod}"


def _other_paths(cfg: ModelConfig) -> Iterator[str]:
    """Module paths of the model that LoRA here cannot adapt (a target matching one is
    refused: peft would adapt the embedding or head, or fail on a norm)."""
    yield from ("model", "model.embed_tokens", "model.layers", "model.norm", "lm_head")
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        yield from (p, f"{p}.self_attn", f"{p}.mlp", f"{p}.mlp.act_fn")
        yield from (f"{p}.input_layernorm", f"{p}.post_attention_layernorm")
        if cfg.qk_norm:
            yield from (f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm")


class _Matcher:
    """peft's ``check_target_module_exists`` for one config."""

    def __init__(self, acfg: dict[str, Any]) -> None:
        targets = _names("target_modules", acfg.get("target_modules"))
        self.all_linear = isinstance(targets, str) and targets.lower() == ALL_LINEAR
        if targets is None:
            targets = list(PEFT_DEFAULT_TARGETS)
        self.targets = targets
        self.target_re = (
            _regex("target_modules", targets)
            if isinstance(targets, str) and not self.all_linear
            else None
        )
        self.exclude = _names("exclude_modules", acfg.get("exclude_modules"))
        self.exclude_re = (
            _regex("exclude_modules", self.exclude) if isinstance(self.exclude, str) else None
        )
        layers = acfg.get("layers_to_transform")
        pattern = acfg.get("layers_pattern")
        if layers is not None and not (
            (isinstance(layers, int) and not isinstance(layers, bool))
            or (
                isinstance(layers, list)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            )
        ):
            raise AdapterConfigError(
                f"layers_to_transform={layers!r} must be a layer index or a list of them"
            )
        if pattern is not None and not (
            isinstance(pattern, str)
            or (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))
        ):
            raise AdapterConfigError(f"layers_pattern={pattern!r} must be a string or a list")
        if isinstance(targets, str) and (layers is not None or pattern is not None):
            raise AdapterConfigError(
                "layers_to_transform / layers_pattern cannot be used when target_modules is a "
                f"string ({targets!r}), as in peft"
            )
        if pattern and layers is None:
            raise AdapterConfigError(
                f"layers_pattern={pattern!r} needs layers_to_transform, as in peft"
            )
        self.layers = None if layers in (None, []) else layers
        self.patterns = [pattern] if isinstance(pattern, str) else (pattern or [])

    def _excluded(self, key: str) -> bool:
        if self.exclude_re is not None:
            return self.exclude_re.fullmatch(key) is not None
        ex = self.exclude or []
        return key in ex or any(key.endswith(f".{e}") for e in ex)

    def _layer_index(self, key: str) -> int | None:
        if not self.patterns:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            m = None
            for p in self.patterns:
                m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
                if m is not None:
                    break
        return None if m is None else int(m.group("idx"))

    def __call__(self, key: str, is_projection: bool) -> bool:
        if self._excluded(key):
            return False
        if self.all_linear:
            return is_projection  # every Linear but the output head
        if self.target_re is not None:
            return self.target_re.fullmatch(key) is not None
        assert isinstance(self.targets, list)
        if key in self.targets:
            return True
        if not any(key.endswith(f".{t}") for t in self.targets):
            return False
        if self.layers is None:
            return True
        idx = self._layer_index(key)
        if idx is None:
            return False
        return idx == self.layers if isinstance(self.layers, int) else idx in self.layers


def parse_adapter_config(acfg: Any, cfg: ModelConfig, max_rank: int) -> AdapterConfig:
    """The served meaning of a parsed ``adapter_config.json``; raises
    :class:`AdapterConfigError` naming the first key it cannot honour."""
    if not isinstance(acfg, dict):
        raise AdapterConfigError(
            f"the config must be a JSON object, not {type(acfg).__name__} "
            "(a PEFT adapter_config.json holds one LoraConfig)"
        )
    unknown = sorted(k for k in acfg if k not in _NO_OP and k not in _HONOURED)
    if unknown:
        raise AdapterConfigError(
            f"unknown key(s) {unknown}: not a setting this server knows how to honour"
        )
    peft_type = acfg.get("peft_type")
    if peft_type != "LORA":
        raise AdapterConfigError(f"peft_type={peft_type!r} is not supported: only 'LORA'")
    for key, ok in _NO_OP.items():
        if key in acfg and not ok(acfg[key]):
            raise AdapterConfigError(f"{key}={acfg[key]!r} is not supported (plain LoRA only)")
    rank = acfg.get("r", PEFT_DEFAULT_R)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise AdapterConfigError(
            f"r={rank!r} must be an integer in [1, max_lora_rank={max_rank}] (raise max_lora_rank)"
        )
    alpha = _number("lora_alpha", acfg.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    rslora = acfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterConfigError(f"use_rslora={rslora!r} must be true or false")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    match = _Matcher(acfg)
    refused = [p for p in _other_paths(cfg) if match(p, is_projection=False)]
    if refused:
        raise AdapterConfigError(
            f"target_modules={acfg.get('target_modules')!r} selects {refused[:3]}: only the "
            f"projections {list(MODULES)} can be adapted"
        )
    targets = frozenset((i, m) for i, m, p in module_paths(cfg) if match(p, is_projection=True))
    if not targets:
        raise AdapterConfigError(
            f"target_modules={acfg.get('target_modules')!r} (exclude_modules="
            f"{acfg.get('exclude_modules')!r}, layers_to_transform="
            f"{acfg.get('layers_to_transform')!r}) selects no projection of this model"
        )
    return AdapterConfig(rank, alpha, scaling, targets)
