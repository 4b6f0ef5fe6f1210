"""``kvcluster bench`` runs benchmarks/cluster_bench.py (the product never imports the
benchmarks): every argument after ``bench`` reaches it. No cluster is started."""

from __future__ import annotations

import subprocess
import sys


def kvcluster(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cluster.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_bench_arguments_reach_the_benchmark() -> None:
    run = kvcluster("bench", "--help")
    assert run.returncode == 0, run.stderr
    assert "usage: kvcluster bench" in run.stdout and "--compare-policies" in run.stdout
    run = kvcluster("bench", "--workers", "2", "--seeds", "0")
    assert run.returncode == 2
    assert "--workers, --seeds: only with --compare-policies" in run.stderr


def test_other_commands_still_reject_unknown_arguments() -> None:
    run = kvcluster("status", "--requests", "3")
    assert run.returncode == 2 and "unrecognized arguments: --requests 3" in run.stderr
