"""OpenMP waits passively in every process that imports the worker package before torch, and
the thread that runs the model runs the engine's intra-op threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.cpu_threads import worker_env
from worker.model.thread_count import available_cores, configure_threads

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import os, sys\n"
    "{first}\n"
    "import torch\n"
    "from worker import cpu_threads\n"
    "print(cpu_threads.effective_wait_policy, os.environ.get('OMP_WAIT_POLICY'))\n"
)


def _probe(first: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_the_worker_package_sets_passive_waits_before_torch_loads() -> None:
    assert _probe("import worker") == "PASSIVE PASSIVE"


def test_an_operators_policy_wins_and_a_late_import_is_reported() -> None:
    assert _probe("import worker", OMP_WAIT_POLICY="active") == "ACTIVE active"
    # torch first: too late to change OpenMP, and nothing pretends otherwise
    assert _probe("import torch") == "None None"


def test_worker_env_leaves_explicit_settings_alone() -> None:
    assert worker_env({}) == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert worker_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"KMP_BLOCKTIME": "0"}
    assert available_cores() >= 1


def test_the_engine_loop_runs_with_its_engines_threads(tiny_dir) -> None:
    """OpenMP's team size is per thread: the loop's thread must apply the engine's count
    itself (it would start from OMP_NUM_THREADS, whatever the building thread set)."""
    import torch

    from worker.engine import Engine, EngineConfig, EngineLoop
    from worker.engine.commands import ComputeThreads

    mine = torch.get_num_threads()
    try:
        engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32, cpu_threads=3))
        assert engine.cpu_threads == torch.get_num_threads() == 3
        torch.set_num_threads(mine)
        with EngineLoop(engine) as front:
            assert front.call(ComputeThreads()) == 3
        # unset: the building thread's count, on the loop's thread too
        engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
        assert engine.cpu_threads == mine
        with EngineLoop(engine) as front:
            assert front.call(ComputeThreads()) == mine
    finally:
        torch.set_num_threads(mine)


def test_the_native_kernels_pool_follows_the_thread_count() -> None:
    import torch

    from worker.attention import native

    kernels = native.load_kernels()
    if kernels is None:
        pytest.skip(f"no native kernels: {native.unavailable_reason()}")
    mine = torch.get_num_threads()
    try:
        assert configure_threads(3) == 3 and kernels.threads == 3
        assert len(kernels.split([5] * 12)) == 3 * native.PIECES_PER_THREAD
        assert configure_threads(1) == 1 and kernels.threads == 1
        assert kernels.split([5] * 12) == [(0, 12)]
    finally:
        configure_threads(mine)


def test_the_thread_count_is_validated() -> None:
    from pydantic import ValidationError

    from worker.engine import EngineConfig

    with pytest.raises(ValidationError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)
    assert EngineConfig().cpu_threads is None
