"""The replayed traces are found from any checkout: the environment first, then
``../shared/traces`` beside the checkout, then beside the repository's main worktree (a
``git worktree`` elsewhere); with none, the trace tests skip with the path they looked at."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.trace_path import TRACE_NAME, find_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("KVCLUSTER_TRACE", raising=False)
    monkeypatch.delenv("KVCLUSTER_TRACES", raising=False)


def git(*args: str | Path) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *map(str, args)],
        check=True,
        capture_output=True,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_a_worktree_finds_the_traces_beside_its_main_worktree(tmp_path):
    main, worktree = tmp_path / "main", tmp_path / "wt" / "a"
    git("init", "-q", main)
    (main / "README").write_text("x")
    git("-C", main, "add", "README")
    git("-C", main, "commit", "-qm", "x")
    git("-C", main, "worktree", "add", "-q", worktree)
    trace = tmp_path / "shared" / "traces" / TRACE_NAME
    assert find_trace(repo=worktree) == tmp_path / "wt" / "shared" / "traces" / TRACE_NAME
    trace.parent.mkdir(parents=True)
    trace.write_text("{}\n")
    assert find_trace(repo=worktree) == trace
    assert find_trace(repo=main) == trace
    beside = tmp_path / "wt" / "shared" / "traces" / TRACE_NAME  # beside the checkout wins
    beside.parent.mkdir(parents=True)
    beside.write_text("{}\n")
    assert find_trace(repo=worktree) == beside


def test_the_environment_names_the_trace_found_or_not(tmp_path, monkeypatch):
    lonely = tmp_path / "checkout"  # not a git repository, nothing beside it
    lonely.mkdir()
    assert find_trace(repo=lonely) == tmp_path / "shared" / "traces" / TRACE_NAME
    monkeypatch.setenv("KVCLUSTER_TRACES", str(tmp_path / "mine"))
    assert find_trace(repo=lonely) == tmp_path / "mine" / TRACE_NAME
    assert find_trace("other.jsonl", repo=lonely) == tmp_path / "mine" / "other.jsonl"
    monkeypatch.setenv("KVCLUSTER_TRACE", str(tmp_path / "t.jsonl"))
    assert find_trace(repo=lonely) == tmp_path / "t.jsonl"
    assert find_trace("other.jsonl", repo=lonely) == tmp_path / "mine" / "other.jsonl"


def test_without_a_trace_the_trace_tests_skip_naming_the_path(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVCLUSTER_TRACES": str(tmp_path)}
    env.pop("KVCLUSTER_TRACE", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + ["tests/benchmarks/test_trace_replay_smoke.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"no trace at {tmp_path / TRACE_NAME}" in run.stdout
    assert "1 skipped" in run.stdout
