"""``kvcluster bench`` runs benchmarks/cluster_bench.py (the product never imports the
benchmarks): every argument after ``bench`` reaches it. No cluster is started.

The command line runs in this process (``cluster.cli.main``); ``bench`` starts its benchmark
in a child process as an installed ``kvcluster`` does, whose output ``capfd`` reads."""

from __future__ import annotations

import pytest

from cluster import cli


def kvcluster(capfd: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``kvcluster ARGS``: (exit code, stdout, stderr)."""
    capfd.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capfd.readouterr()
    return code, out, err


def test_bench_arguments_reach_the_benchmark(capfd) -> None:
    code, out, err = kvcluster(capfd, "bench", "--help")
    assert code == 0, err
    assert "usage: kvcluster bench" in out and "--compare-policies" in out
    code, _, err = kvcluster(capfd, "bench", "--workers", "2", "--seeds", "0")
    assert code == 2
    assert "--workers, --seeds: only with --compare-policies" in err


def test_other_commands_still_reject_unknown_arguments(capfd) -> None:
    code, _, err = kvcluster(capfd, "status", "--requests", "3")
    assert code == 2 and "unrecognized arguments: --requests 3" in err
