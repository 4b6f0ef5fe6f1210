"""benchmarks.penalty_counts runs at smoke size (both ways sample the same tokens, checked
inside) and ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import penalty_counts


def test_penalty_counts_smoke(capsys: pytest.CaptureFixture) -> None:
    head = penalty_counts.main(["--smoke", "--device", "cpu"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    for p in (256, 2048):
        assert head[f"penalty_counts_p{p}_recount_ms"] > 0
        assert head[f"penalty_counts_p{p}_incremental_ms"] > 0
