"""OpenMP waits passively in every process that imports the worker package before torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.cpu_threads import available_cores, worker_env

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
