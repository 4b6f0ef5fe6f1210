"""The host-tier benchmarks' --smoke runs: their JSON lines parse, the tier raises the hit
rate (simulator and real CPU engine), and the engine's outputs are identical with it on
(figures, not timings, are asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import host_tier_engine, host_tier_sim
from benchmarks.workloads import DEFAULT_TRACE


def _headline(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.skipif(not Path(DEFAULT_TRACE).exists(), reason=f"no trace at {DEFAULT_TRACE}")
def test_host_tier_sim_smoke(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    host_tier_sim.main(["--smoke"])
    h = _headline(capsys)
    assert h["hit_rate_device_only"] < h["hit_rate_host8x"] <= h["hit_rate_unbounded"]
    assert (tmp_path / "host_tier_sim.png").stat().st_size > 0


def test_host_tier_engine_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    host_tier_engine.main(["--smoke"])
    h = _headline(capsys)
    assert h["outputs_identical"] and h["hit_rate_on"] > h["hit_rate_off"]
