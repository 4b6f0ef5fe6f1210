"""benchmarks.kv_pull_warm at smoke size: two real clusters; the added worker of the one with
pulls warm-starts by itself (the router asks it) with the 4 hottest prefixes and reaches
the fleet's median no later than the cold one; one parseable JSON line and a PNG."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_pull_warm

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_kv_pull_warm_smoke(
    capsys: pytest.CaptureFixture, monkeypatch, tmp_path, ray_shared
) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = kv_pull_warm.main(["--smoke"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == head
    assert head["pulled_blocks"] == 16  # the 4 hottest 64-token prefixes, 4 blocks each
    assert head["reached_warm_requests"] <= head["reached_cold_requests"]
    assert (tmp_path / "kv_pull_warm.png").stat().st_size > 0
