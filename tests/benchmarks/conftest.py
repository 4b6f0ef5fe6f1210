"""The benchmarks' smoke runs: tiny models on one torch thread, as in tests/engine/."""

from __future__ import annotations

from tests.engine.conftest import _one_torch_thread  # noqa: F401 - the package's autouse fixture
