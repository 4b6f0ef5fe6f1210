"""The disk-tier simulator benchmark's --smoke run: its JSON line parses, the disk tier
raises the hit rate above host-only without passing the unbounded cache, the working set
exceeds device + host, and the plot is written (figures, not timings, are asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import disk_tier_sim
from benchmarks.workloads import DEFAULT_TRACE


@pytest.mark.skipif(
    not DEFAULT_TRACE.exists(), reason=f"no trace at {DEFAULT_TRACE} (see benchmarks/trace_path.py)"
)
def test_disk_tier_sim_smoke(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    disk_tier_sim.main(["--smoke"])
    out = capsys.readouterr().out
    h = json.loads(out.strip().splitlines()[-1])
    assert h["benchmark"] == "disk_tier_sim" and h["smoke"]
    assert h["hit_rate_host_only"] < h["hit_rate_disk"] <= h["hit_rate_unbounded"]
    assert h["disk_hit_rate"] > 0 and h["working_set_x"] > 1
    gap = (h["hit_rate_unbounded"] - h["hit_rate_disk"]) / h["hit_rate_unbounded"]
    assert h["hit_gap_disk"] == pytest.approx(gap, abs=1e-4)
    assert h["target_met"] == (h["hit_gap_disk"] <= disk_tier_sim.TARGET_HIT_GAP)
    # the rows: the reference, host only, the headline size under both admission rules
    assert "unbounded" in out and "host only" in out and "disk 8x admit 2" in out
    assert (tmp_path / "disk_tier_sim.png").stat().st_size > 0
