"""benchmarks.http_edge runs at smoke size: both parsers stream every token (checked
inside), the flood runs beside generation on a real cluster, gated and ungated, and it ends
with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import http_edge

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]


def test_http_edge_smoke(capsys: pytest.CaptureFixture) -> None:
    head = http_edge.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["h11_cpu_ms_tok"] > 0 and head["httptools_cpu_ms_tok"] > 0
    for gate in ("gated", "ungated"):
        assert head[f"flood_{gate}_kept"] > 0 and head[f"flood_{gate}_probes_per_s"] > 0
