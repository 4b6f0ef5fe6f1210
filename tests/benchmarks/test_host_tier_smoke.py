"""The host-tier benchmarks' --smoke runs: their JSON lines parse, the tier raises the hit
rate (simulator and real CPU engine), and the engine's outputs are identical with it on
(figures, not timings, are asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import host_tier_engine, host_tier_sim
from benchmarks.workloads import DEFAULT_TRACE, trace_requests

TRACE = DEFAULT_TRACE  # as the benchmark reads it


def _headline(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.skipif(
    not TRACE.exists(), reason=f"no trace at {TRACE} (see benchmarks/trace_path.py)"
)
def test_host_tier_sim_smoke(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    host_tier_sim.main(["--smoke"])
    out = capsys.readouterr().out
    h = json.loads(out.strip().splitlines()[-1])
    assert h["hit_rate_device_only"] < h["hit_rate_host8x"] <= h["hit_rate_unbounded"]
    # every row replays the same requests: the smoke trace's 600 less those no device fits
    lengths = [len(r.token_ids) for r in trace_requests(TRACE, limit=600)]
    too_big = sum(-(-n // 512) > 100_000 // 512 for n in lengths)
    assert too_big > 0 and h["requests_left_out"] == too_big
    assert h["requests"] == 600 - too_big
    assert f"same {600 - too_big} requests; {too_big} of the trace's 600" in out
    assert (tmp_path / "host_tier_sim.png").stat().st_size > 0


def test_host_tier_engine_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    host_tier_engine.main(["--smoke"])
    h = _headline(capsys)
    assert h["outputs_identical"] and h["hit_rate_on"] > h["hit_rate_off"]
