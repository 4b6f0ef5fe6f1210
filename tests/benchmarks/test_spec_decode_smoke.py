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
    assert head["edit_c1_ngram_accept_len"] > 1.0  # the edit answer repeats its prompt
    assert (tmp_path / "spec_decode.png").stat().st_size > 0
