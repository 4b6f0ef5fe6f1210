"""Load safetensors checkpoints (single file or sharded with an index) into a model.

Every expected tensor is checked (present, right shape) before any is copied, so a bad
folder fails fast with a message naming the tensor, the expected and the found shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from worker.model.load_errors import ModelLoadError, WeightMismatchError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that are recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal checkpoint (Gemma3ForConditionalGeneration): the language model's tensors under
# these prefixes (the Hub's layout, then transformers 5's module paths), and the vision tower
# and projector, which a text-only model never reads.
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_MAX_NAMES = 5  # tensor names quoted in one error message


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the safetensors file that holds it."""
    root = Path(model_dir)
    index, single = root / INDEX_FILE, root / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from exc
        shards = {name: root / shard for name, shard in weight_map.items()}
        missing = sorted({p.name for p in shards.values() if not p.is_file()})
        if missing:
            raise ModelLoadError(
                f"{index} names shard files that are missing: {', '.join(missing)}"
            )
        return shards
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    hint = (
        " (PyTorch .bin checkpoints are not supported; convert to safetensors)"
        if any(n.endswith(".bin") for n in present)
        else ""
    )
    raise ModelLoadError(
        f"{root}: no {SINGLE_FILE} or {INDEX_FILE} found{hint}; folder has: "
        f"{', '.join(present) or 'nothing'}"
    )


def _ignored(name: str, expected: dict[str, tuple[int, ...]]) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # A tied model may still ship lm_head.weight (a copy of the embedding).
    return name == "lm_head.weight" and "lm_head.weight" not in expected


def _names(names: list[str]) -> str:
    more = f" (+{len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else ""
    return ", ".join(names[:_MAX_NAMES]) + more


def text_model_names(names: list[str], source: str) -> tuple[dict[str, str], list[str]]:
    """Of a multimodal checkpoint's tensor names: the language model's, as a causal LM names
    them (-> the checkpoint's name), and the names that are neither its nor the vision's."""
    out: dict[str, str] = {}
    stray = []
    for name in names:
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p[0])), None)
        if prefix is None:
            stray.append(name)
            continue
        ours = prefix[1] + name[len(prefix[0]) :]
        if ours in out:
            raise WeightMismatchError(f"{source}: both {out[ours]} and {name} hold {ours}")
        out[ours] = name
    return out, stray


def load_weights(model: nn.Module, model_dir: str | Path, multimodal: bool = False) -> None:
    """Copy the checkpoint into ``model``'s parameters (converting dtype, moving device);
    ``multimodal``: only the language model of the checkpoint is read."""
    params = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in params.items()}
    stored = checkpoint_files(model_dir)
    stray: list[str] = []
    if multimodal:
        renamed, stray = text_model_names(list(stored), str(model_dir))
    else:
        renamed = {name: name for name in stored}
    files = {name: stored[ckpt] for name, ckpt in renamed.items()}
    missing = sorted(set(expected) - set(files))
    if missing:
        raise WeightMismatchError(
            f"{model_dir}: checkpoint lacks {len(missing)} expected tensors: {_names(missing)}"
        )
    unexpected = sorted(n for n in files if n not in expected and not _ignored(n, expected))
    unexpected = sorted([*(renamed[n] for n in unexpected), *stray])
    if unexpected:
        raise WeightMismatchError(
            f"{model_dir}: checkpoint has {len(unexpected)} tensors this architecture does not "
            f"use: {_names(unexpected)}"
        )
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                found = tuple(f.get_slice(renamed[name]).get_shape())
                if found != expected[name]:
                    raise WeightMismatchError(
                        f"{path.name}: tensor {renamed[name]} has shape {list(found)}, "
                        f"expected {list(expected[name])} from config.json"
                    )
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    params[name].copy_(f.get_tensor(renamed[name]))
