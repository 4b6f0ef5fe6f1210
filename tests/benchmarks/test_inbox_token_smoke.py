"""benchmarks.inbox_token runs at smoke size (every token read, checked inside) and ends
with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import inbox_token


def test_inbox_token_smoke(capsys: pytest.CaptureFixture) -> None:
    head = inbox_token.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["inbox_token_cpu_us"] > 0 and head["inbox_token_cpu_us_baseline"] > 0
