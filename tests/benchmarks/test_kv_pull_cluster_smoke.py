"""benchmarks.kv_pull_cluster at smoke size: four real clusters (with and without pulls, two
policies) serve the workload at two loads with no failure; one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_pull_cluster

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def test_kv_pull_cluster_smoke(
    capsys: pytest.CaptureFixture, monkeypatch, tmp_path, ray_shared
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = kv_pull_cluster.main(["--smoke"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == head
    assert head["failures"] == 0
    assert len(head["affinity_pull_req_s_ratios"]) == 2
    assert (tmp_path / "kv_pull_cluster.png").stat().st_size > 0
