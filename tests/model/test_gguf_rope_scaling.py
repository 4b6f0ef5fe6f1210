"""Rope scaling in GGUF files and folders, against transformers: Llama 3.1 / 3.2 GGUFs (the
converter writes llama3 scaling as a ``rope_freqs.weight`` tensor of divisors) and Qwen2 with
YaRN (``rope.scaling.*`` metadata; folders with ``rope_scaling: {type: yarn}``).

transformers' GGUF loader reads neither (its config comes back with default rope), so its
GGUF reference is given the folder's config: its weights, read by its own GGUF loader, with
the scaling the checkpoint was trained with.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tests.model.gguf_writer import write_gguf
from tests.model.helpers import BlockHandout, hf_logits
from worker.model.config import ModelConfig
from worker.model.layers import rope_inv_freq
from worker.model.load_errors import ModelLoadError, UnsupportedModelError
from worker.model.runner import ModelRunner, SeqChunk

transformers = pytest.importorskip("transformers")

# Original context 256 at head_dim 16, theta 1e6: dimensions 0-2 fall on YaRN's ramp, the rest
# are interpolated; prompts run past the original context of the llama folder (64).
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (1, 9, 90)]


def _logits(path) -> torch.Tensor:
    runner = ModelRunner(path, block_size=4, num_blocks=64)
    blocks = BlockHandout(runner.num_blocks)
    prompts = _prompts(runner.config.vocab_size)
    chunks = [SeqChunk(p, 0, blocks.table(len(p), 4), "all") for p in prompts]
    return runner.execute(runner.build_input(chunks))


def _reference(model, vocab: int) -> torch.Tensor:
    return torch.cat([hf_logits(model, p) for p in _prompts(vocab)])


def _hf_gguf(path, folder):
    """transformers' own GGUF loading of ``path``, with the folder's (rope) config."""
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    return model.eval()


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def yarn_dir(model_dirs, tmp_path_factory):
    return _with_config(
        model_dirs["qwen2"], tmp_path_factory.mktemp("yarn") / "qwen2-yarn", rope_scaling=YARN
    )


def test_llama3_gguf_rope_freqs_equal_the_folder_and_transformers(model_dirs, tmp_path):
    """Llama 3.1 / 3.2 as llama.cpp writes them: ``rope_freqs.weight`` (and interleaved Q/K)."""
    folder = model_dirs["llama"]
    path = write_gguf(folder, tmp_path / "llama3.gguf")
    cfg, ref = ModelConfig.from_dir(path), ModelConfig.from_dir(folder)
    assert cfg.rope.freq_factors is not None and max(cfg.rope.freq_factors) == 8.0
    torch.testing.assert_close(
        rope_inv_freq(cfg.rope, cfg.head_dim), rope_inv_freq(ref.rope, ref.head_dim)
    )
    ours = _logits(path)
    vocab = cfg.vocab_size
    torch.testing.assert_close(ours, _reference(_hf_gguf(path, folder), vocab), atol=1e-4, rtol=0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.testing.assert_close(ours, _reference(theirs.eval(), vocab), atol=1e-4, rtol=0)


def test_yarn_folder_equals_transformers(yarn_dir):
    cfg = ModelConfig.from_dir(yarn_dir)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.attention_factor > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(yarn_dir, dtype=torch.float32)
    torch.testing.assert_close(
        _logits(yarn_dir), _reference(model.eval(), cfg.vocab_size), atol=1e-4, rtol=0
    )


def test_yarn_qwen2_gguf_equals_transformers(yarn_dir, model_dirs, tmp_path):
    path = write_gguf(yarn_dir, tmp_path / "qwen2-yarn.gguf", arch="qwen2")
    cfg, ref = ModelConfig.from_dir(path), ModelConfig.from_dir(yarn_dir)
    assert cfg.rope.rope_type == "yarn"
    assert cfg.rope.original_max_position_embeddings == 256
    assert cfg.rope.attention_factor == pytest.approx(ref.rope.attention_factor)
    ours = _logits(path)
    plain = _logits(model_dirs["qwen2"])  # the same weights without scaling
    assert (ours - plain).abs().max() > 0.05  # the scaling matters at these positions
    reference = _reference(_hf_gguf(path, yarn_dir), cfg.vocab_size)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


def test_bad_rope_freqs_and_yarn_variants_are_refused(model_dirs, tmp_path):
    from gguf import GGUFReader

    folder = model_dirs["llama"]
    path = write_gguf(folder, tmp_path / "ok.gguf")
    offset = next(t for t in GGUFReader(path).tensors if t.name == "rope_freqs.weight")
    data = bytearray(path.read_bytes())
    start = int(offset.data_offset)
    data[start : start + 4] = bytes(4)  # the first divisor becomes 0
    bad = tmp_path / "zero.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="rope_freqs.weight holds values that are not"):
        ModelConfig.from_dir(bad)
    with pytest.raises(UnsupportedModelError, match="rope type 'longrope'"):
        ModelConfig.from_dict(
            {
                **json.loads((folder / "config.json").read_text()),
                "rope_scaling": {"type": "longrope"},
            }
        )
