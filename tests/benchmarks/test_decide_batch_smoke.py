"""benchmarks.decide_batch runs at smoke size against a real redis-server, places every
burst the same both ways, and ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import decide_batch

pytestmark = pytest.mark.redis


def test_decide_batch_smoke(capsys: pytest.CaptureFixture) -> None:
    head = decide_batch.main(["--smoke"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == head
    assert head["same_decisions"] is True  # (the run asserts it)
    assert head["cpu_us_one_by_one"] > 0 and head["cpu_us_together"] > 0
    assert 1 <= head["batches_per_burst"] <= 32  # a burst of 32 takes at most 32 batches
