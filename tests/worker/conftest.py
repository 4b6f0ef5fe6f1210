"""The engine tests' tiny Llama, on one torch thread (tests/engine/conftest.py)."""

from __future__ import annotations

from tests.engine.conftest import _one_torch_thread, tiny_dir  # noqa: F401 - fixtures
