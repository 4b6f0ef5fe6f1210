"""``kvcluster tokenizer DIR`` writes the served model's tokenizer as a Hugging Face folder
that ``transformers.AutoTokenizer`` (what ``vllm bench serve --tokenizer`` uses) loads to the
same token ids and chat template, from a GGUF model as from a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.vllm_bench import vllm_command
from cluster.cli import main
from cluster.config import load_config
from cluster.settings import resolve_model
from worker.model.default_model import resolve_default_model
from worker.model.tokenizer import Tokenizer

TEXTS = ("Blocks are keyed by their prefix.", "naïve café — 東京 🙂", "")


@pytest.mark.slow
def test_exported_tokenizer_matches_the_servers(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    assert main(["tokenizer", str(out)]) == 0  # the embedded default model (GGUF)
    cfg = load_config(None)
    path, _ = resolve_model(cfg)
    ours = Tokenizer.from_dir(path or resolve_default_model(cfg.model.tiny_family))
    theirs = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert theirs(text, add_special_tokens=False).input_ids == ours.encode(text, False)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.render_chat(msgs)
    again = Tokenizer.from_dir(out)  # and kvcluster reads its own export back
    assert again.encode(TEXTS[1]) == ours.encode(TEXTS[1])


def test_vllm_bench_is_skipped_without_a_vllm_venv(tmp_path: Path) -> None:
    assert vllm_command(str(tmp_path / "no-venv" / "bin" / "python")) is None
