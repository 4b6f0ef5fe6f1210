"""benchmarks.edge_token runs at smoke size (old and new SSE bytes compared inside) and
ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import edge_token


def test_edge_token_smoke(capsys: pytest.CaptureFixture) -> None:
    head = edge_token.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["sse_completions_us_new"] > 0 and head["sse_chat_us_old"] > 0
    assert head["label_us_new"] > 0 and head["grpc_message_us"] > 0


def test_grpc_floor_smoke(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import grpc_floor

    head = grpc_floor.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    # every message arrived (``run`` checks the count); the server's CPU is read in clock
    # ticks (10 ms), which the smoke's 128 messages may not reach
    assert head["grpc_generator_us_per_msg"] >= 0 and head["grpc_writer_us_per_msg"] >= 0
