"""The LoRA benchmarks at smoke size: one parseable JSON line each; figures, not timings."""

from __future__ import annotations

import json

import pytest

from benchmarks import lora_routing, lora_throughput


def _headline(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_lora_throughput_smoke(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    lora_throughput.main(["--smoke"])
    head = _headline(capsys)
    assert head["same_tokens"] is True  # mixed batch == one adapter at a time, token for token
    assert head["mixed_tok_s"] > 0 and head["one_at_a_time_tok_s"] > 0
    assert head["slot_bytes"] == 131072  # tiny model, r=16, float32 (see slot_bytes)
    assert head["slot_bytes_llama3_8b_bf16"] == 83886080  # 32 layers x 16 x 81920 x 2 B


def test_lora_routing_smoke(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    lora_routing.main(["--smoke"])
    head = _headline(capsys)
    assert head["hit_rate_aware"] > head["hit_rate_blind"] > 0
    assert (tmp_path / "lora_routing.png").stat().st_size > 0
