"""Tiny random models of every family, built once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.model.gguf_reference import ParsedOnce, reader_cache
from worker.model.build_tiny import FAMILIES, build_tiny_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: build_tiny_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def hf_model():
    """Loads (and caches) the transformers reference model of a folder, float32, eval."""
    transformers = pytest.importorskip("transformers")
    cache = {}

    def load(path: Path, dtype: str = "float32"):
        key = (path, dtype)
        if key not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            cache[key] = model.eval()
        return cache[key]

    return load


@pytest.fixture(scope="package")
def gguf_reader() -> Iterator[ParsedOnce]:
    """``gguf_reader(path)``: the package's one ``gguf.GGUFReader`` of a real GGUF file
    (tests/model/gguf_reference.py); the readers go with the package."""
    reader, clear = reader_cache()
    yield reader
    clear()
