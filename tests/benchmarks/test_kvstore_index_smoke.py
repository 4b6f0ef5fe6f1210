"""The kvstore benchmark runs end to end at its smoke size (numbers are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import kvstore_index

pytestmark = pytest.mark.redis  # the benchmark starts its own redis-server


def test_benchmark_smoke(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    kvstore_index.main(["--smoke", "--record-every", "2"])
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert head["kvstore_record_every"] == 2
    assert head["kvstore_entries"] == 20_000 // 2048 // 4 * 2048 * 4 // 2
    assert head["kvstore_bytes_per_entry"] > 0
    for mode in ("bisect", "scan"):  # both lookup modes measured, answers checked on the way
        for n in ("128", "2048", "2048_staggered"):
            assert head[f"kvstore_lookup_{mode}_{n}_p99_ms"] > 0
    assert (tmp_path / "kvstore_lookup.png").exists()
