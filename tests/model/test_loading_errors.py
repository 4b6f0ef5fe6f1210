"""A bad model folder fails at load with a message naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from worker.model.load_errors import ModelLoadError, UnsupportedModelError, WeightMismatchError
from worker.model.runner import ModelRunner
from worker.model.tokenizer import Tokenizer


@pytest.fixture
def folder(model_dirs, tmp_path) -> Path:
    """A private copy of the tiny llama folder to break."""
    return Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def load(path: Path) -> ModelRunner:
    return ModelRunner(path, num_blocks=8, block_size=4)


def test_unsupported_architecture_names_value_and_supported_list(folder):
    edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError) as err:
        load(folder)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load(folder)


def test_missing_weights_file_lists_folder(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match="no model.safetensors or model.safetensors.index.json"
    ):
        load(folder)


def test_missing_tensor_is_named(folder):
    edit_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        WeightMismatchError, match=r"lacks 1 expected .*layers\.1\.self_attn\.k_proj"
    ):
        load(folder)


def test_mismatched_shape_names_tensor_and_both_shapes(folder):
    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(127, 64)

    edit_weights(folder, shrink)
    with pytest.raises(WeightMismatchError) as err:
        load(folder)
    msg = str(err.value)
    assert "model.layers.0.mlp.up_proj.weight" in msg and "[127, 64]" in msg and "[128, 64]" in msg


def test_config_that_disagrees_with_weights(folder):
    edit_config(folder, intermediate_size=96)
    with pytest.raises(
        WeightMismatchError, match=r"gate_proj.weight has shape \[128, 64\], expected \[96, 64\]"
    ):
        load(folder)


def test_unexpected_tensor_is_named(folder):
    edit_weights(
        folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
    )
    with pytest.raises(WeightMismatchError, match="does not use: model.layers.0.self_attn.q_norm"):
        load(folder)


def test_sharded_checkpoint_loads_identically(folder, model_dirs):
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, folder / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "model.safetensors").unlink()
    sharded = load(folder).model.state_dict()
    single = load(model_dirs["llama"]).model.state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing: model-00002-of-00002.safetensors"):
        load(folder)


@pytest.mark.parametrize(
    ("changes", "pattern", "error"),
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "rope type 'dynamic'.*default, linear, llama3, yarn",
            UnsupportedModelError,
        ),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads=4 is not a multiple of num_key_value_heads=3",
            ModelLoadError,
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'", UnsupportedModelError),
        ({"hidden_size": None}, "required key 'hidden_size' is missing", ModelLoadError),
        (
            {"num_hidden_layers": "2"},
            "num_hidden_layers='2' must be a positive integer",
            ModelLoadError,
        ),
    ],
)
def test_invalid_config_values(folder, changes, pattern, error):
    edit_config(folder, **changes)
    with pytest.raises(error, match=pattern):
        ModelConfig.from_dir(folder)


def test_transformers5_rope_parameters_layout_is_accepted(folder):
    cfg = json.loads((folder / "config.json").read_text())
    legacy = ModelConfig.from_dir(folder)
    params = dict(cfg.pop("rope_scaling"), rope_theta=cfg.pop("rope_theta"))
    new = ModelConfig.from_dict(dict(cfg, rope_parameters=params))
    assert new == legacy


def test_missing_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json not found"):
        Tokenizer.from_dir(folder)
