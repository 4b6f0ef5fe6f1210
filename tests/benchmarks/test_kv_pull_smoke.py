"""benchmarks.kv_pull runs at smoke size: outputs identical, one parseable JSON line (the
warm-start benchmark needs a cluster: tests/benchmarks/test_kv_pull_warm_smoke.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_pull


def test_kv_pull_engine_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = kv_pull.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["same_outputs"] is True and head["prefix_tokens"] == 256
    assert head["pull_ms"] > 0 and head["recompute_ms"] >= 0  # (a difference: noisy at smoke size)
    assert (tmp_path / "kv_pull_engine.png").stat().st_size > 0
