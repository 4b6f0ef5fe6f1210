"""The decode benchmark runs end to end at its smoke size (figures are not asserted)."""

from __future__ import annotations

import json

import pytest
import torch


def test_model_decode_benchmark_smoke(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from benchmarks.model_decode import main

    monkeypatch.setenv("KVCLUSTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path / "results"))
    threads = torch.get_num_threads()
    try:
        main(["--smoke", "--batch-sizes", "1,3", "--new-tokens", "4"])
    finally:
        torch.set_num_threads(threads)
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["bench"] == "model_decode" and headline["size"] == "tiny"
    assert headline["greedy_match"] is True  # same greedy tokens as transformers
    assert {"ours_tok_s_b1", "hf_tok_s_b3", "ratio_b3"} <= headline.keys()
    assert (tmp_path / "results" / "model_decode.png").stat().st_size > 0


def test_gpu_engine_benchmark_smoke(tmp_path, monkeypatch, capsys):
    """On the CPU: the engine part of the GPU benchmark at its smoke size."""
    pytest.importorskip("transformers")
    from benchmarks.gpu_engine import main

    monkeypatch.setenv("KVCLUSTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path / "results"))
    main(["--smoke", "--skip-kernels"])
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["model"] == "tiny" and headline["engine_tok_s"] > 0
    assert headline["decode_step_ms"] > 0 and headline["speedup_vs_transformers"] > 0


def test_gguf_load_benchmark_smoke(capsys):
    from benchmarks.gguf_load import main

    main(["--smoke", "--vocab", "2000", "--repeats", "1"])
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["bench"] == "gguf_load" and headline["size"] == "smoke"
    assert headline["synthetic_ours_s"] > 0 and headline["synthetic_speedup"] > 0
    assert headline["synthetic_warm_s"] > 0 and headline["synthetic_cache_speedup"] > 0
