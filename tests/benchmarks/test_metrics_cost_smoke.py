"""benchmarks.metrics_cost runs at smoke size, both settings, and ends with one JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import metrics_cost

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def test_metrics_cost_smoke(capsys: pytest.CaptureFixture, ray_shared) -> None:
    head = metrics_cost.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    for api in ("http", "grpc"):
        for side in metrics_cost.SIDES:
            assert head[f"tiny_{api}_8_{side}_cpu_on_off"] > 0  # both settings ran and served
        assert head[f"tiny_{api}_8_tok_s_on_off"] > 0
