"""benchmarks.router_cost runs at smoke size (every token arrived, checked inside) and ends
with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import router_cost

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def test_router_cost_smoke(capsys: pytest.CaptureFixture, ray_shared) -> None:
    head = router_cost.main(["--smoke"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == head
    for api in ("grpc", "http"):
        assert head[f"{api}_ms_per_request"] > 0  # a request costs the router something
