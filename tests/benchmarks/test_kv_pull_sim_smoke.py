"""benchmarks.kv_pull_sim's --smoke run: its JSON line parses, pulls raise the affinity
policy's hit rate, and no policy beats the shared pool."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_pull_sim
from benchmarks.workloads import DEFAULT_TRACE


@pytest.mark.skipif(
    not DEFAULT_TRACE.exists(), reason=f"no trace at {DEFAULT_TRACE} (see benchmarks/trace_path.py)"
)
def test_kv_pull_sim_smoke(capsys: pytest.CaptureFixture[str], monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = kv_pull_sim.main(["--smoke", "--policies", "prefix_affinity"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == head
    assert head["hit_rate_affinity"] < head["hit_rate_affinity_pull"]
    assert head["hit_rate_affinity_pull"] <= head["hit_rate_shared_pool"]
    assert (tmp_path / "kv_pull_sim.png").stat().st_size > 0
