"""benchmarks/spec_decode.py at its smoke size: runs, prints its JSON line, draws its plot,
and speculation never changes a greedy token."""

from __future__ import annotations

import json

import pytest


def test_spec_decode_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    from benchmarks import spec_decode

    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = spec_decode.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    same = [v for k, v in head.items() if k.endswith("_same_tokens")]
    assert same and all(same)
    assert all(v >= 1.0 for k, v in head.items() if k.endswith("_accept_len"))
    # the repeating workloads draft and accept (the tiny model's answers repeat its prompt)
    assert (
        max(v for k, v in head.items() if k.startswith(("json", "agentic")) and "accept" in k) > 1
    )
    assert (tmp_path / "spec_decode.png").stat().st_size > 0


def test_spec_routing_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    """benchmarks/spec_routing.py: follow-ups on the session's own worker and on another,
    the acceptance of each; the placement never changes a greedy token."""
    from benchmarks import spec_routing

    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = spec_routing.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["same_tokens"] is True
    assert head["own_accept_len"] >= 1.0 and head["other_accept_len"] >= 1.0
    assert head["own_tok_s"] > 0 and head["other_tok_s"] > 0
