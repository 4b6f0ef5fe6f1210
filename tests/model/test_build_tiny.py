"""The offline tiny-model builder: format, determinism, caching, sizes."""

from __future__ import annotations

import hashlib
import json

import pytest

from worker.model.build_tiny import SIZES, build_tiny_model, main, model_config
from worker.model.config import ModelConfig
from worker.model.loader import tensor_shapes
from worker.model.tiny_tokenizer import SPECIAL_TOKENS


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_folder_has_the_hugging_face_files(model_dirs):
    names = {p.name for p in model_dirs["qwen2"].iterdir()}
    expected = {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert expected <= names
    tok_cfg = json.loads((model_dirs["qwen2"] / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"] and tok_cfg["eos_token"] == "</s>"


def test_same_seed_same_bytes_and_cache_hit(model_dirs, tmp_path):
    again = build_tiny_model(tmp_path / "llama", "llama", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(again / name) == digest(model_dirs["llama"] / name)
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(again, "llama", seed=0) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    other = build_tiny_model(again, "llama", seed=1)  # a stale build is replaced
    assert digest(other / "model.safetensors") != digest(model_dirs["llama"] / "model.safetensors")


def test_refuses_to_overwrite_a_foreign_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        build_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="family='gpt2' is not one of llama, mistral"):
        build_tiny_model(tmp_path / "x", "gpt2")


def test_command_line(tmp_path, capsys):
    main(["--out", str(tmp_path / "q"), "--family", "qwen3", "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "q")
    assert ModelConfig.from_dir(tmp_path / "q").architecture == "Qwen3ForCausalLM"


def test_100m_size_is_about_100m_parameters():
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    cfg = ModelConfig.from_dict(model_config("llama", "100m", ids))
    params = sum(_numel(s) for s in tensor_shapes(cfg).values())
    assert 90e6 < params < 110e6
    assert cfg.vocab_size == SIZES["100m"]["vocab"]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_tokenizer_module_does_not_import_torch():
    """The router tokenizes with worker.model.tokenizer and must not pay for torch."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, worker.model.tokenizer; assert 'torch' not in sys.modules"
    root = Path(__file__).parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)
