"""Gemma 3 on the tiny random folder against transformers: each attention backend with its
per-layer sliding windows, the GGUF form (llama.cpp's names, norms stored as 1 + weight),
the chat template, LoRA through peft.

The tiny folder (``build_tiny --family gemma3``): 7 layers, five sliding-window (12 tokens)
layers, a global one, a sliding one; rope bases 1e4 (local) and 1e6 with linear scaling x2
(global); query_pre_attn_scalar 24 != head_dim 16; tied, scaled embeddings.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tests.model.gguf_writer import write_gguf
from tests.model.helpers import BlockHandout, hf_logits, interleaved_steps
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.config import ModelConfig
from worker.model.lora import load_adapter
from worker.model.runner import ModelRunner, SeqChunk
from worker.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(model_dirs):
    return model_dirs["gemma3"]


@pytest.fixture(scope="module")
def gguf_pair(folder, tmp_path_factory):
    """(GGUF file, the folder it equals): llama.cpp keeps no query_pre_attn_scalar (it uses
    head_dim for every size but 27B), so the file is written from a copy that says so."""
    root = tmp_path_factory.mktemp("gemma3-gguf")
    twin = root / "twin"
    shutil.copytree(folder, twin)
    raw = json.loads((twin / "config.json").read_text())
    raw["query_pre_attn_scalar"] = raw["head_dim"]
    (twin / "config.json").write_text(json.dumps(raw))
    return write_gguf(twin, root / "gemma3.gguf", arch="gemma3"), twin


def test_config_traits_and_the_transformers_5_layout(folder, hf_model):
    cfg = ModelConfig.from_dir(folder)
    assert cfg.sliding_windows == (12,) * 5 + (None, 12)
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "linear" and cfg.rope.factor == 2
    assert cfg.local_rope.theta == 1e4 and cfg.local_rope.rope_type == "default"
    assert cfg.layer_rope(5) is cfg.rope and cfg.layer_rope(6) is cfg.local_rope
    assert cfg.attention_scale == 24**-0.5 and cfg.tie_word_embeddings and cfg.qk_norm
    # as transformers 5 saves it: rope_parameters per layer type
    assert ModelConfig.from_dict(hf_model(folder).config.to_dict()) == cfg


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backends_with_per_layer_windows_equal_transformers(folder, hf_model, backend):
    runner = ModelRunner(folder, block_size=4, num_blocks=64, attn_backend=backend)
    assert runner.backend.name == backend
    rng = random.Random(1)
    seqs = [[rng.randrange(5, 500) for _ in range(n)] for n in (33, 30)]
    for seq, got in zip(seqs, interleaved_steps(runner, seqs), strict=True):
        torch.testing.assert_close(got, hf_logits(hf_model(folder), seq), atol=1e-4, rtol=0)


def test_gguf_equals_the_folder_and_transformers_gguf_loading(gguf_pair, hf_model):
    path, twin = gguf_pair
    cfg, ref = ModelConfig.from_dir(path), ModelConfig.from_dir(twin)
    for field in ("sliding_windows", "rope", "local_rope", "attention_scale", "hidden_act"):
        assert getattr(cfg, field) == getattr(ref, field), field
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 13, 40)]
    runner = ModelRunner(path, block_size=4, num_blocks=64)
    blocks = BlockHandout(runner.num_blocks)
    chunks = [SeqChunk(p, 0, blocks.table(len(p), 4), "all") for p in prompts]
    ours = runner.execute(runner.build_input(chunks))
    # transformers' GGUF loader reads neither rope scaling nor query scale from the file:
    # it gets the folder's config, its own loader reads the weights
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        config=transformers.AutoConfig.from_pretrained(twin),
        dtype=torch.float32,
    ).eval()
    for reference in (theirs, hf_model(twin)):
        expected = torch.cat([hf_logits(reference, p) for p in prompts])
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_chat_template_renders_from_folder_and_gguf_metadata(folder, gguf_pair):
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    chats = [
        [{"role": "user", "content": "Hi!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is a cache?"},
            {"role": "assistant", "content": "  A store.  "},
            {"role": "user", "content": "And paged?"},
        ],
    ]
    for tok in (Tokenizer.from_dir(folder), Tokenizer.from_dir(gguf_pair[0])):
        for messages in chats:
            for gen in (True, False):
                text = tok.render_chat(messages, add_generation_prompt=gen)
                assert text == theirs.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=gen
                )
        text = tok.render_chat(chats[1])
        assert text.startswith("<s><start_of_turn>user\nBe brief.\n\nWhat is a cache?")
        assert text.endswith("<start_of_turn>model\n")
        with pytest.raises(ValueError, match="roles must alternate"):
            tok.render_chat([{"role": "assistant", "content": "first"}])


def test_lora_on_gemma3_equals_peft(folder, tmp_path):
    """An adapter on all seven projections applies at the same points as peft's."""
    peft = pytest.importorskip("peft")
    path = build_tiny_lora(tmp_path / "a", folder, rank=4, seed=3)
    runner = ModelRunner(folder, block_size=4, num_blocks=64)
    runner.enable_lora(max_loras=1, max_rank=8)
    adapter = load_adapter("a", path, runner.config, max_rank=8)
    prompt = [5, 9, 30, 41, 7] * 4
    blocks = BlockHandout(runner.num_blocks)
    batch = runner.build_input([SeqChunk(prompt, 0, blocks.table(len(prompt), 4), "all")])
    ours = runner.execute(batch, adapters=[adapter])
    base_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base_model, str(path)).eval()  # wraps it in place
    torch.testing.assert_close(ours, hf_logits(model, prompt), atol=1e-4, rtol=0)
    with model.disable_adapter():
        base = hf_logits(model, prompt)
    assert (ours - base).abs().max() > 0.1  # the adapter changes the logits


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"layer_types": ["full_attention"]}, "must give 7 entries"),
        ({"sliding_window": 0}, "sliding_window=0 must be a positive integer"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ],
)
def test_what_gemma3_parsing_refuses(folder, changes, pattern):
    from worker.model.load_errors import ModelLoadError

    raw = {**json.loads((folder / "config.json").read_text()), **changes}
    with pytest.raises(ModelLoadError, match=pattern):  # UnsupportedModelError included
        ModelConfig.from_dict(raw)
