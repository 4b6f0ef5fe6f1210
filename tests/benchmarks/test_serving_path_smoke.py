"""benchmarks.serving_path runs at smoke size and ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import serving_path

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def test_serving_path_smoke(
    capsys: pytest.CaptureFixture, monkeypatch, tmp_path, ray_shared
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = serving_path.main(
        ["--smoke", "--trace-stalls", "--vllm-python", str(tmp_path / "no-vllm")]
    )
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert "vllm offline: skipped" in out  # (and so no served leg)
    for api in ("http", "grpc"):
        assert head[f"tiny_{api}_8_ratio"] > 0  # every token arrived (the run asserts it)
        assert 0 < head[f"tiny_{api}_8_submits_per_req"] <= 1  # a call carries >= 1 request
        assert 0 <= head[f"tiny_{api}_8_engine_waits"] <= 1  # a share of the run's wall time
    assert head["max_worker_lag_ms"] >= 0 and head["max_router_lag_ms"] >= 0
    assert 0 <= head["max_router_own_lag_ms"] <= head["max_router_lag_ms"]
    burst = head["tiny_burst"]
    assert burst["requests"] == 16 and burst["steps"] >= 0 and burst["ms"] > 0
    fan = head["fanout"]
    assert fan["workers"] == 2 and fan["served_tok_s"] > 0 and fan["router_cpu_share"] > 0
    assert (tmp_path / "serving_path.png").stat().st_size > 0
