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

from worker.model.errors import ModelLoadError, WeightMismatchError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that are recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
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


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy the checkpoint into ``model``'s parameters (converting dtype, moving device)."""
    params = model.state_dict()
    expected = {name: tuple(t.shape) for name, t in params.items()}
    files = checkpoint_files(model_dir)
    missing = sorted(set(expected) - set(files))
    if missing:
        raise WeightMismatchError(
            f"{model_dir}: checkpoint lacks {len(missing)} expected tensors: {_names(missing)}"
        )
    unexpected = sorted(n for n in files if n not in expected and not _ignored(n, expected))
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
                found = tuple(f.get_slice(name).get_shape())
                if found != expected[name]:
                    raise WeightMismatchError(
                        f"{path.name}: tensor {name} has shape {list(found)}, expected "
                        f"{list(expected[name])} from config.json"
                    )
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in names:
                    params[name].copy_(f.get_tensor(name))
