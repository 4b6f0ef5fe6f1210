"""benchmarks.engine_throughput runs at smoke size and ends with one parseable JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_throughput


def test_engine_throughput_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = engine_throughput.main(["--smoke", "--vllm-python", str(tmp_path / "no-vllm")])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert "vllm: skipped" in out
    assert head["greedy_match_transformers"] == 1.0  # same tokens as transformers generate
    assert head["prefix_same_outputs"] is True
    assert head["prefix_hit_rate"] > 0.3  # 48 of ~80 tokens of every later prompt are cached
    assert head["engine_tok_s"] > 0 and head["transformers_static_tok_s"] > 0
    assert (tmp_path / "engine_throughput.png").stat().st_size > 0


def test_engine_beside_a_cpu_burner_smoke(capsys: pytest.CaptureFixture) -> None:
    head = engine_throughput.main(["--neighbour", "--smoke", "--rounds", "1"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert "quiet/busy" in out and "torch default" in out
    for key in ("worker", "torch_default"):
        assert head[f"neighbour_{key}_quiet_tok_s"] > 0 and head[f"neighbour_{key}_busy_tok_s"] > 0


def test_engine_step_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    from benchmarks import engine_step

    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = engine_step.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert head["tiny_8_tok_s"] > 0
    assert 0 < head["tiny_8_host_ms"] and 0 < head["tiny_8_host_share"] < 1
    assert "schedule ms" in out and "forward ms" in out
    assert (tmp_path / "engine_step.png").stat().st_size > 0
    assert all(head[f"rows_{n}_{kind}_ms"] > 0 for n in (1, 2, 4) for kind in ("decode", "extend"))
    assert (tmp_path / "engine_step_rows.png").stat().st_size > 0


def test_engine_step_host_only_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    """The forward replaced by fixed logits: host stages only, on this tree and a baseline
    (the same tree here), which gives the same tokens."""
    from benchmarks import engine_step

    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    head = engine_step.main(["--smoke", "--host-only", "--baseline", str(engine_step.ROOT)])
    capsys.readouterr()
    assert head["tiny_8_tok_s"] > 0 and 0 < head["tiny_8_host_ms"]
    assert head["tiny_8_same_tokens"] is True


def test_worker_loop_smoke(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import worker_loop

    head = worker_loop.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    assert "concurrent submit" in out and "submit_many" in out
    assert head["hook_16_ratio"] > 0 and head["hook_16_queued_ms"] > 0
    assert head["burst_loop_cpu_ratio"] > 0 and head["burst_max_stall_ms"] >= 0


def test_loop_latency_smoke(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import loop_latency
    from kvstore.runtime.loop_sched import custom_slices
    from kvstore.runtime.threadsched import nice

    head = loop_latency.main(["--smoke"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == head
    for policy in loop_latency.POLICIES:
        assert head[f"thread_{policy}_max_ms"] >= head[f"thread_{policy}_p99_ms"] >= 0
        assert head[f"thread_{policy}_matmul_ratio"] > 0
        # each run's policy was in effect: the loop's slice, the compute threads' niceness
        short = policy in ("slice", "both") and custom_slices()
        assert (head[f"thread_{policy}_loop_slice_ms"] == 0.1) == short
        demoted = nice() + (5 if policy in ("nice", "both") else 0)
        assert head[f"thread_{policy}_compute_nice"] == min(demoted, 19)
