"""The trace-replay benchmark's --smoke run: its JSON line parses and prefix_affinity beats
round_robin on token hit rate (figures, not timings, are asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import trace_replay
from benchmarks.workloads import DEFAULT_TRACE


@pytest.mark.skipif(
    not DEFAULT_TRACE.exists(), reason=f"no trace at {DEFAULT_TRACE} (see benchmarks/trace_path.py)"
)
def test_trace_replay_smoke(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    trace_replay.main(["--smoke", "--workload", "trace", "--limit", "600"])
    out = capsys.readouterr().out.strip().splitlines()
    headline = json.loads(out[-1])
    pa, rr = (headline[f"trace_w8_{p}_hit_rate"] for p in ("prefix_affinity", "round_robin"))
    assert pa > rr > 0
    assert headline["trace_w8_parity_mismatches"] == 0
    assert (tmp_path / "trace_replay.png").stat().st_size > 0
