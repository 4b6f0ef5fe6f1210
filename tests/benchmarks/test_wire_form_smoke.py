"""benchmarks.wire_form runs at smoke size (every message reads back equal, checked inside)
and ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import wire_form


def test_wire_form_smoke(capsys: pytest.CaptureFixture) -> None:
    head = wire_form.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    for key in ("SamplingParams", "WorkerRequest", "Admitted"):
        assert head[f"wire_{key}_by_name_us"] > 0 and head[f"wire_{key}_ratio"] > 0
    assert head["wire_step_output_lp0_us"] > 0 and head["wire_step_output_lp5_us"] > 0
