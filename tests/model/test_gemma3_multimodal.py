"""The language model of a ``Gemma3ForConditionalGeneration`` folder (gemma-3 4b and up),
served text-only: a tiny random multimodal model saved by transformers (the tiny Gemma 3
folder's weights as its language model, a random vision tower beside them) against
transformers' own multimodal class on text, and the sparse ``text_config`` of the Hub's
configs read with transformers' defaults."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.helpers import BlockHandout, hf_logits
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.config import ModelConfig
from worker.model.load_errors import ModelLoadError, UnsupportedModelError, WeightMismatchError
from worker.model.lora import LoraError, load_adapter
from worker.model.runner import ModelRunner, SeqChunk

transformers = pytest.importorskip("transformers")
MM = "Gemma3ForConditionalGeneration"
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
# gemma-3-4b's text_config as the Hub's config.json gives it (the rest: transformers' defaults)
HUB_4B = {
    "architectures": [MM],
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model"},
}


@pytest.fixture(scope="module")
def text_folder(model_dirs):
    return model_dirs["gemma3"]


@pytest.fixture(scope="module")
def mm_pair(text_folder, tmp_path_factory):
    """(multimodal folder, transformers' model of it), its language model the text folder's."""
    text = json.loads((text_folder / "config.json").read_text())
    cfg = transformers.Gemma3Config(
        text_config={k: v for k, v in text.items() if k != "architectures"},
        vision_config={**VISION, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4,
        boi_token_index=509,
        eoi_token_index=510,
        image_token_index=511,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    lm = transformers.AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    out = tmp_path_factory.mktemp("gemma3-mm") / "mm"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text_folder / name, out / name)
    return out, model


def _logits(path, prompts):
    runner = ModelRunner(path, block_size=4, num_blocks=64)
    blocks = BlockHandout(runner.num_blocks)
    return runner.execute(
        runner.build_input([SeqChunk(p, 0, blocks.table(len(p), 4), "all") for p in prompts])
    )


def test_config_is_the_text_config(mm_pair, text_folder):
    folder, _ = mm_pair
    assert json.loads((folder / "config.json").read_text())["architectures"] == [MM]
    cfg = ModelConfig.from_dir(folder)
    assert cfg.multimodal == MM and cfg.architecture == "Gemma3ForCausalLM"
    assert dataclasses.replace(cfg, multimodal=None) == ModelConfig.from_dir(text_folder)


def test_language_model_equals_transformers_on_text(mm_pair, text_folder):
    folder, theirs = mm_pair
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 9, 30)]  # past the window
    ours = _logits(folder, prompts)
    expected = torch.cat([hf_logits(theirs, p) for p in prompts])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, _logits(text_folder, prompts), atol=0, rtol=0)


def test_transformers_5_module_layout_loads_the_same(mm_pair, tmp_path):
    """Tensors named by the model's modules (``model.language_model.``, ``model.vision_tower.``)
    rather than the Hub's ``language_model.model.``."""
    folder, _ = mm_pair
    other = tmp_path / "mm5"
    shutil.copytree(folder, other)
    tensors = load_file(other / "model.safetensors")
    renamed = {
        k.replace("language_model.model.", "model.language_model.")
        .replace("vision_tower.", "model.vision_tower.")
        .replace("multi_modal_projector.", "model.multi_modal_projector."): v
        for k, v in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, other / "model.safetensors")
    prompt = [[7, 8, 9, 10, 11]]
    torch.testing.assert_close(_logits(other, prompt), _logits(folder, prompt), atol=0, rtol=0)


def test_hub_4b_text_config_reads_with_transformers_defaults():
    ours = ModelConfig.from_dict(HUB_4B)
    full = transformers.Gemma3Config(**HUB_4B).to_dict()  # every default spelled out
    full["architectures"] = [MM]
    assert ModelConfig.from_dict(full) == ours
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (8, 4, 256)
    assert (ours.vocab_size, ours.num_layers, ours.eos_token_ids) == (262208, 34, (1, 106))
    assert ours.sliding_windows == ((1024,) * 5 + (None,)) * 5 + (1024,) * 4
    assert ours.rope.rope_type == "linear" and ours.rope.factor == 8.0
    assert ours.local_rope.theta == 10000.0 and ours.torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("changes", "error", "pattern"),
    [
        ({"text_config": None}, ModelLoadError, r"text_config=None must be an object"),
        (
            {"text_config": {**HUB_4B["text_config"], "model_type": "gemma2"}},
            UnsupportedModelError,
            r"text_config\.model_type='gemma2' is not supported",
        ),
        (
            {"text_config": {**HUB_4B["text_config"], "num_attention_heads": 0}},
            ModelLoadError,
            r"config\.json text_config: num_attention_heads=0 must be a positive integer",
        ),
    ],
)
def test_what_the_multimodal_parsing_refuses(changes, error, pattern):
    with pytest.raises(error, match=pattern):
        ModelConfig.from_dict({**HUB_4B, **changes})


def test_a_stray_tensor_and_lora_adapters_are_refused(mm_pair, text_folder, tmp_path):
    folder, _ = mm_pair
    other = tmp_path / "stray"
    shutil.copytree(folder, other)
    tensors = load_file(other / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)  # neither the text nor the vision's
    save_file(tensors, other / "model.safetensors")
    with pytest.raises(WeightMismatchError, match=r"does not use: model\.layers\.0\.extra"):
        ModelRunner(other, block_size=4, num_blocks=8)
    adapter = build_tiny_lora(tmp_path / "a", text_folder, rank=4)
    with pytest.raises(LoraError, match=rf"'a': .*not served on the language model of a {MM}"):
        load_adapter("a", adapter, ModelConfig.from_dir(folder), max_rank=8)
