"""Every tensor type the GGUF loader supports, against a dequantization written in the test
(``gguf_dequant``, from ggml's block layouts): random blocks of each type in every matrix of
a small model whose rows fit K-quant blocks (256 wide), loaded tensors equal to the reference
dequantization; and a ``Q4_K_M``-style mix (Q4_K, Q6_K, Q5_0, Q8_0, F32 norms, as llama.cpp
mixes them) whose logits equal those of a folder holding the reference weights, in this
runner and in transformers (its folder and its own GGUF loading of the file)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import save_file

from tests.model.gguf_dequant import dequantize_rows, random_rows
from tests.model.gguf_writer import write_gguf
from tests.model.helpers import BlockHandout
from worker.model.build_tiny import random_weights
from worker.model.config import ModelConfig
from worker.model.gguf_weights import SUPPORTED_QUANT_TYPES, hf_name
from worker.model.runner import ModelRunner, SeqChunk

QUANTIZED = [q for q in SUPPORTED_QUANT_TYPES if q != QType.F32]
# llama.cpp's Q4_K_M keeps attn_v / ffn_down at Q6_K, the rest at Q4_K; Q5_0 and Q8_0 appear
# where rows do not fit 256 (and in the embedding of small models)
MIX = {"token_embd": QType.Q8_0, "attn_v": QType.Q6_K, "ffn_down": QType.Q6_K, "attn_k": QType.Q5_0}
PROMPTS = [[1, 40, 41, 42], list(range(5, 25)), [1, 300, 7, 9, 11, 13]]


@pytest.fixture(scope="module")
def base(model_dirs, tmp_path_factory):
    """The tiny mistral's tokenizer with K-quant-sized matrices: hidden 256, MLP 512."""
    out = tmp_path_factory.mktemp("quant") / "wide"
    shutil.copytree(model_dirs["mistral"], out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(hidden_size=256, intermediate_size=512, num_hidden_layers=1, head_dim=64)
    (out / "config.json").write_text(json.dumps(raw))
    weights = random_weights(ModelConfig.from_dict(raw), seed=4, dtype=torch.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write(base, path, type_of):
    """Write ``base`` with each matrix as random blocks of ``type_of(gguf_name)``; returns the
    file and the reference dequantization of every matrix (Hugging Face names)."""
    rng = np.random.default_rng(0)
    expected: dict[str, np.ndarray] = {}

    def encode(name, data):
        qtype = type_of(name)
        if data.ndim == 1 or qtype is None:
            return None
        rows, cols = data.shape
        raw = random_rows(rows, cols, qtype, rng)
        values = dequantize_rows(raw, qtype, cols)
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        kind = name.split(".")[-2]
        if kind in heads:  # stored interleaved for llama.cpp's rotary: the model's rows are
            values = values.reshape(heads[kind], -1, 2, cols).swapaxes(1, 2).reshape(rows, cols)
        expected[hf_name(name)] = values
        return raw, qtype

    cfg = json.loads((base / "config.json").read_text())
    return write_gguf(base, path, encode=encode), expected


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_every_type_loads_as_the_reference_dequantization(base, tmp_path, qtype):
    path, expected = _write(base, tmp_path / f"{qtype.name}.gguf", lambda name: qtype)
    got = ModelRunner(path, block_size=4, num_blocks=8).model.state_dict()
    assert len(expected) == 9  # embedding, lm_head, q/k/v/o, gate/up/down
    for name, want in expected.items():
        assert np.isfinite(want).all() and np.abs(want).max() > 0.01, name
        torch.testing.assert_close(got[name], torch.from_numpy(want), atol=1e-6, rtol=1e-5)


def _logits(path) -> torch.Tensor:
    runner = ModelRunner(path, block_size=4, num_blocks=32)
    blocks = BlockHandout(runner.num_blocks)
    chunks = [SeqChunk(p, 0, blocks.table(len(p), 4), "all") for p in PROMPTS]
    return runner.execute(runner.build_input(chunks))


def test_k_m_mix_equals_the_reference_weights_here_and_in_transformers(base, tmp_path):
    transformers = pytest.importorskip("transformers")

    def type_of(name):
        return MIX.get(name.split(".")[-2] if name.startswith("blk.") else name[:-7], QType.Q4_K)

    path, expected = _write(base, tmp_path / "mix.gguf", type_of)
    reference = tmp_path / "reference"
    shutil.copytree(base, reference)
    weights = {**random_weights(ModelConfig.from_dir(base), seed=4, dtype=torch.float32)}
    weights.update({n: torch.from_numpy(w.copy()) for n, w in expected.items()})
    save_file(weights, str(reference / "model.safetensors"), metadata={"format": "pt"})
    ours = _logits(path)
    torch.testing.assert_close(ours, _logits(reference), atol=1e-5, rtol=0)
    models = [
        transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32),
        transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ),
    ]
    for model in models:
        with torch.no_grad():
            want = torch.cat([model.eval()(torch.tensor([p])).logits[0] for p in PROMPTS])
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)
