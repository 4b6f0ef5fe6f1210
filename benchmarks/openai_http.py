"""The OpenAI HTTP API under load: ``kvcluster bench`` over gRPC and over HTTP, and NVIDIA's
``aiperf`` (a load generator written by others) against the same local cluster.

One cluster (2 CPU workers, the offline tiny model, 4 shared system prompts) serves three
runs of the same shape: ``kvcluster bench --api grpc`` (the baseline), ``--api http`` (the
same prompts through the HTTP edge: the price of JSON + SSE over protobuf), and ``aiperf
profile`` with its own synthetic prompts (``--num-prefix-prompts`` shared prefixes of
``--prefix-prompt-length`` tokens, streaming completions, fixed output length). aiperf
counts tokens with the model's own tokenizer folder and reads ``cached_tokens`` from the
usage the server reports.

aiperf pins its own dependencies; install it in a virtualenv of its own and point at it:

    python -m venv ~/aiperf-venv && ~/aiperf-venv/bin/pip install aiperf
    .venv/bin/python -m benchmarks.openai_http --aiperf ~/aiperf-venv/bin/aiperf
    .venv/bin/python -m benchmarks.openai_http --smoke          # seconds; aiperf if found

vLLM's own load tool runs too when a vLLM virtualenv is found (``--vllm-python``, or
``$VLLM_PYTHON``, default ``~/vllm-venv/bin/python``; its CPU build is enough): ``vllm bench
serve`` with both OpenAI backends (completions, chat) on vLLM's ``random`` and
``prefix_repetition`` datasets, counting tokens with the tokenizer folder the server
exports (``kvcluster tokenizer DIR``); see ``benchmarks/vllm_bench.py``:

    python -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm   # CPU build: see vLLM docs
    .venv/bin/python -m benchmarks.openai_http --vllm-python ~/vllm-venv/bin/python

Without aiperf (not given, not on PATH, not in $AIPERF) or vLLM the two ``kvcluster bench``
runs still go. aiperf's Mooncake-trace replay (``--custom-dataset-type mooncake_trace``) is not
used: offline, aiperf 0.13's trace synthesis rejects the local tokenizer folder that its
synthetic mode accepts (HFValidationError, "repo id must be ..."; not investigated), and
the trace's ~12k-token prompts would need shrinking for the tiny model anyway; the trace
itself is replayed by ``benchmarks/trace_replay.py``. Ends with a table, a PNG and one
JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.loadgen import run_bench
from benchmarks.vllm_bench import DEFAULT_VLLM_PYTHON, run_vllm_bench, vllm_command
from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from worker.model.default_model import resolve_default_model
from worker.model.tokenizer import Tokenizer

ENGINE = {
    "num_blocks": 256,
    "block_size": 16,
    "max_waiting": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "max_model_len": 1024,
}


def cluster_config() -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "name": f"openai-http-bench-{os.getpid()}",
            "dashboard": False,
            "model": {"tiny_family": "llama"},
            "workers": {"num_workers": 2, "num_cpus_per_worker": 0.1, "engine": ENGINE},
            "router": {"port": 0, "http_port": 0},
        }
    )


def run_aiperf(
    aiperf: str,
    url: str,
    model: str,
    tokenizer: str,
    *,
    requests: int,
    concurrency: int,
    groups: int,
    prefix_tokens: int,
    max_tokens: int,
    out_dir: Path,
) -> dict[str, float]:
    cmd = [
        aiperf,
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        tokenizer,
        "--use-server-token-count",
        "--num-prefix-prompts",
        str(groups),
        "--prefix-prompt-length",
        str(prefix_tokens),
        "--synthetic-input-tokens-mean",
        "24",
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(max_tokens),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",
        "temperature:0",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--random-seed",
        "0",
        "--artifact-dir",
        str(out_dir),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    d = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    prompt = d.get("usage_prompt_tokens", {}).get("avg", 0) or 0
    cached = d.get("usage_prompt_cache_read_tokens", {}).get("avg", 0) or 0
    errors = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    return {
        "ok": float(d["request_count"]["avg"]) - errors,
        "throughput_req_s": d["request_throughput"]["avg"],
        "output_tok_s": d["output_token_throughput"]["avg"],
        "ttft_p50_s": d["time_to_first_token"]["p50"] / 1e3,
        "ttft_p99_s": d["time_to_first_token"]["p99"] / 1e3,
        "latency_p50_s": d["request_latency"]["p50"] / 1e3,
        "latency_p99_s": d["request_latency"]["p99"] / 1e3,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
    }


def find_aiperf(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("AIPERF"), shutil.which("aiperf")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", help="aiperf executable (default: $AIPERF, then PATH)")
    ap.add_argument(
        "--vllm-python",
        default=DEFAULT_VLLM_PYTHON,
        help="python of a venv with vLLM, for `vllm bench serve` (default: $VLLM_PYTHON, "
        "then ~/vllm-venv/bin/python); skipped when absent",
    )
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="a few requests per run")
    args = ap.parse_args(argv)
    requests = 12 if args.smoke else args.requests
    concurrency = 4 if args.smoke else args.concurrency
    groups, prefix_words = 4, 200
    aiperf = find_aiperf(args.aiperf)
    vllm = vllm_command(args.vllm_python)
    if vllm is None:
        print(f"vllm bench serve: skipped (no vLLM in {args.vllm_python}; --vllm-python)")
    rows = []
    with Cluster(cluster_config()) as cluster:
        shape = dict(
            num_requests=requests,
            concurrency=concurrency,
            num_groups=groups,
            prefix_words=prefix_words,
            max_tokens=args.max_tokens,
            plot=False,
            out=io.StringIO(),
        )
        apis = (("grpc", cluster.endpoints[0]), ("http", cluster.http_endpoints[0]))
        for api, target in apis:  # warm-up (first-use costs) outside the measured runs
            run_bench(
                target,
                api=api,
                num_requests=2,
                concurrency=1,
                num_groups=1,
                prefix_words=8,
                max_tokens=2,
                seed=99,
                plot=False,
                out=io.StringIO(),
            )
        for api, target in apis:
            # a seed of its own per run: the second run must not find the first's prefixes
            seed = {"grpc": 0, "http": 1}[api]
            figs = run_bench(target, api=api, seed=seed, **shape)  # type: ignore[arg-type]
            rows.append({"run": f"kvcluster bench --api {api}", **figs})
        if aiperf:
            tokenizer = cluster.model_path or str(resolve_default_model("llama"))
            with tempfile.TemporaryDirectory() as tmp:
                figs = run_aiperf(
                    aiperf,
                    cluster.http_endpoints[0],
                    cluster.model_id,
                    tokenizer,
                    requests=requests,
                    concurrency=concurrency,
                    groups=groups,
                    prefix_tokens=prefix_words,
                    max_tokens=args.max_tokens,
                    out_dir=Path(tmp),
                )
            rows.append({"run": "aiperf (http)", "requests": float(requests), **figs})
        if vllm is not None:
            rows += _vllm_runs(vllm, cluster, requests, concurrency, groups, args.max_tokens)
    cols = (
        "ok",
        "throughput_req_s",
        "output_tok_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "latency_p50_s",
        "latency_p99_s",
        "prefix_hit_rate",
    )
    table = [{"run": r["run"], **{c: round(float(r[c]), 4) for c in cols}} for r in rows]
    print_table(
        table,
        f"{requests} requests, concurrency {concurrency}, {groups} shared "
        f"prefixes, {args.max_tokens} output tokens (2 CPU workers, tiny model)",
    )
    grpc_row, http_row = rows[0], rows[1]
    headline = {
        "requests": requests,
        "grpc_ttft_p50_s": grpc_row["ttft_p50_s"],
        "http_ttft_p50_s": http_row["ttft_p50_s"],
        "http_vs_grpc_throughput": http_row["throughput_req_s"] / grpc_row["throughput_req_s"],
        "http_vs_grpc_ttft_p50": http_row["ttft_p50_s"] / grpc_row["ttft_p50_s"],
    }
    if aiperf:
        a = rows[2]
        headline.update(
            aiperf_ttft_p50_s=a["ttft_p50_s"],
            aiperf_ttft_p99_s=a["ttft_p99_s"],
            aiperf_req_s=a["throughput_req_s"],
            aiperf_out_tok_s=a["output_tok_s"],
            aiperf_hit_rate=a["prefix_hit_rate"],
        )
    for r in rows:
        if r["run"].startswith("vllm bench"):
            key = r["run"].split(" ", 3)[-1].replace(" ", "_").replace("-", "_")
            headline[f"{key}_req_s"] = r["throughput_req_s"]
            headline[f"{key}_failed"] = r["failed"]
    _plot(rows)
    emit_json({"openai_http": headline})
    return 0


def _vllm_runs(
    vllm: list[str], cluster: Cluster, requests: int, concurrency: int, groups: int, max_tokens: int
) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # the tokenizer folder `kvcluster tokenizer DIR` writes
        model = cluster.model_path or str(resolve_default_model("llama"))
        tokenizer = str(Tokenizer.from_dir(model).save(Path(tmp) / "tokenizer"))
        for backend in ("openai", "openai-chat"):
            for dataset in ("random", "prefix_repetition"):
                figs = run_vllm_bench(
                    vllm,
                    cluster.http_endpoints[0],
                    cluster.model_id,
                    tokenizer,
                    backend=backend,
                    dataset=dataset,
                    requests=requests,
                    concurrency=concurrency,
                    prefix_len=128,
                    suffix_len=32,
                    groups=groups,
                    max_tokens=max_tokens,
                    out_dir=Path(tmp),
                )
                rows.append({"run": f"vllm bench {backend} {dataset}", **figs})
    return rows


def _plot(rows: list[dict]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["run"] for r in rows]
    ax[0].bar(names, [r["ttft_p50_s"] * 1e3 for r in rows], label="p50")
    ax[0].bar(
        names,
        [(r["ttft_p99_s"] - r["ttft_p50_s"]) * 1e3 for r in rows],
        bottom=[r["ttft_p50_s"] * 1e3 for r in rows],
        alpha=0.5,
        label="p99",
    )
    ax[0].set_ylabel("TTFT (ms)")
    ax[0].legend()
    ax[1].bar(names, [r["throughput_req_s"] for r in rows])
    ax[1].set_ylabel("requests / s")
    for a in ax:
        a.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    return save_figure(fig, "openai_http.png")


if __name__ == "__main__":
    raise SystemExit(main())
