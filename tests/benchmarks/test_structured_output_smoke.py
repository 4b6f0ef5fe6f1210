"""benchmarks.structured_output runs at smoke size (tiny random model: every output must
still parse and validate, the grammar does it) and ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import structured_output
from benchmarks.structured_schemas import schemas, tool_requests


def test_structured_output_smoke(capsys: pytest.CaptureFixture) -> None:
    head = structured_output.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["structured_valid_whole"] == 1.0 and head["structured_valid_streamed"] == 1.0
    assert head["structured_tool_required_valid"] == 1.0
    assert head["structured_free_steps_s"] > 0 and head["structured_constrained_steps_s"] > 0
    assert 0 < head["structured_cache_hit_rate"] < 1


def test_the_full_workload_is_large_and_varied() -> None:
    full = schemas()
    assert len(full) >= 50 and len({json.dumps(s) for s in full}) == len(full)
    text = json.dumps(full)
    for keyword in ('"enum"', '"minimum"', '"maximum"', '"items"', '"anyOf"', '"const"'):
        assert keyword in text, keyword
    assert any(p.get("type") == "object" for s in full for p in s.get("properties", {}).values())
    assert len(tool_requests()) == 50
