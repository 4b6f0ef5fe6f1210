"""Session fixtures: one tiny random Llama folder and its transformers twin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker.model.build_tiny import build_tiny_model


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine they lose
    10x to oversubscription; restored afterwards for other test packages."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("engine-model") / "llama", "llama", "tiny")


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_dir: Path):
    from worker.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_dir)
