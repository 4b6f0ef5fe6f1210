"""benchmarks.http_edge runs at smoke size: both parsers stream every token (checked
inside), the flood runs beside generation on a real cluster (gated; the smoke starts one),
and it ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import http_edge

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def test_http_edge_smoke(capsys: pytest.CaptureFixture, ray_shared) -> None:
    head = http_edge.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["h11_cpu_ms_tok"] > 0 and head["httptools_cpu_ms_tok"] > 0
    assert head["flood_gated_kept"] > 0 and head["flood_gated_probes_per_s"] > 0
    assert head["flood_gated_router_cpu_ms_probe"] > 0
