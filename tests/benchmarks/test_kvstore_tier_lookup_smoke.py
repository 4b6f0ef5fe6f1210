"""The tier-lookup benchmark runs end to end at its smoke size (numbers are not asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import kvstore_tier_lookup

pytestmark = pytest.mark.redis  # the benchmark starts its own redis-server


def test_tier_lookup_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    kvstore_tier_lookup.main(["--smoke"])  # every answer is checked against the layout
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for layout in ("full", "staggered"):
        for mode in ("bisect", "scan"):
            key = f"tier_lookup_{layout}_{mode}_lookup_tiers_tiered_server_p50_ms"
            assert head[key] > 0
