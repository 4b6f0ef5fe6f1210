"""The serving path at engine speed: what a served worker delivers against its own engine
offline, on the same model, config and workload, in one run.

    python -m benchmarks.serving_path            # light + 32M models, 32/128/256 streams
    python -m benchmarks.serving_path --smoke    # tiny model, seconds
    python -m benchmarks.serving_path --models light --streams 128 256

Workload: ``--streams`` prompts of ``--prompt`` random token ids, ``--max-tokens`` tokens
each (greedy, ``ignore_eos``), all at once. Systems:

* ``offline``: this engine in this process, every request added, stepped to the end;
* ``http``: a cluster of one worker and one router (``Cluster``), one SSE stream per prompt on
  ``/v1/completions`` (aiohttp, one asyncio loop);
* ``grpc``: the same cluster, one ``Generate`` stream per prompt (``grpc.aio``, one channel);
* ``vllm``: vLLM's CPU build offline, in its own venv (``--vllm-python``), as
  ``engine_throughput`` runs it; skipped with a note when absent.

Reported per run: tok/s, served / offline, messages per stream (fewer than tokens when
coalesced), the largest event-loop stall of the worker and of the router during the run
(their loop-lag probes), and the engine thread's busy share. Then: a burst of
``--burst`` requests arriving at a busy worker (time and engine steps until all were taken
in), the offline step split by stage (schedule, model, sampling/outputs, the rest), and a
``--fanout-workers`` run on the tiny model: can one router forward that many workers'
output (its CPU share while doing it, and the rate one core would carry). Prefix caching is
off, so repeated prompts across runs never hit. Table, PNG, one JSON line.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

import ray

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.engine_throughput import DEFAULT_VLLM_PYTHON, run_vllm
from benchmarks.serving_probes import burst_admission, engine_busy, loop_lags, router_cpu
from benchmarks.stream_clients import run_grpc, run_http
from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.model.build_tiny import build_tiny_model


def engine_config(streams: int, prompt: int, max_tokens: int, burst: int) -> dict:
    per_seq = -(-(prompt + max_tokens) // 16)
    return {
        "block_size": 16,
        "num_blocks": per_seq * (streams + burst) + 64,
        "max_num_seqs": streams,
        "max_waiting": streams + burst,
        "max_num_batched_tokens": 2048,
        "max_model_len": 2 * (prompt + max_tokens),
        "enable_prefix_caching": False,
    }


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]


def offline(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts added, stepped to the end; tok/s and each stage's share of the steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    spent = {"schedule": 0.0, "model": 0.0, "sample+outputs": 0.0}
    timed = {
        "schedule": (engine.scheduler, "schedule"),
        "model": (engine.executor, "execute"),
        "sample+outputs": (engine.processor, "process"),
    }
    originals = {}
    for stage, (obj, name) in timed.items():
        fn = originals[stage] = getattr(obj, name)

        def wrapped(*a: Any, _fn: Any = fn, _stage: str = stage, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_stage] += time.perf_counter() - t0

        setattr(obj, name, wrapped)
    try:
        for p in prompts:
            engine.add_request(p, params)
        tokens = steps = 0
        step_s = 0.0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            step_s += time.perf_counter() - t0
            steps += 1
            tokens += sum(len(d.token_ids) for o in outs for d in o.outputs)
        wall = time.perf_counter() - start
    finally:
        for stage, (obj, name) in timed.items():
            setattr(obj, name, originals[stage])
    stages = {k: v / step_s for k, v in spent.items()}
    stages["rest"] = 1.0 - sum(stages.values())
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "steps": steps,
        "step_ms": 1e3 * step_s / steps,
        "stages": stages,
    }


def cluster_config(name: str, model_dir: Path, workers: int, engine: dict) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "name": name,
            "dashboard": False,
            "model": {"path": str(model_dir)},
            "workers": {"num_workers": workers, "num_cpus_per_worker": 0.1, "engine": engine},
            "router": {"port": 0, "http_port": 0},
        }
    )


def served(cluster: Cluster, api: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """One served run: tok/s, messages, the loops' largest stalls, the engine's busy share."""
    loop_lags(cluster, reset=True)
    busy0 = engine_busy(cluster)
    t0 = time.perf_counter()
    if api == "http":
        model = ray.get(
            next(iter(cluster.routers.values())).__ray_call__.remote(lambda r: r.settings.model_id)
        )
        run = run_http(cluster.http_endpoints[0], model, prompts, max_tokens)
    else:
        run = run_grpc(cluster.endpoints[0], prompts, max_tokens)
    wall = time.perf_counter() - t0
    lags = loop_lags(cluster, reset=False)
    busy1 = engine_busy(cluster)
    expected = len(prompts) * max_tokens
    assert run.tokens == expected, f"{api}: {run.tokens} tokens, expected {expected}"
    return {
        "tok_s": run.tok_s,
        "msgs/stream": run.messages / len(prompts),
        "worker lag ms": lags["worker"],
        "router lag ms": lags["router"],
        "engine busy": None if busy0 is None or busy1 is None else (busy1 - busy0) / wall,
    }


def bench_model(size: str, args: argparse.Namespace, rows: list[dict], extra: dict) -> None:
    model_dir = build_tiny_model(None, "llama", size, 0)
    top = max(args.streams)
    engine_cfg = engine_config(top, args.prompt, args.max_tokens, args.burst)
    engine = Engine.from_model_dir(model_dir, EngineConfig(**engine_cfg))
    vocab = engine.executor.vocab_size
    offline(engine, make_prompts(min(8, top), args.prompt, vocab, 99), 4)  # warm-up
    base: dict[int, dict] = {}
    for n in args.streams:
        base[n] = offline(engine, make_prompts(n, args.prompt, vocab, n), args.max_tokens)
        rows.append(
            {
                "model": size,
                "streams": n,
                "system": "offline",
                "tok/s": base[n]["tok_s"],
                "served/offline": 1.0,
            }
        )
    extra[f"{size}_stages"] = {k: round(v, 3) for k, v in base[top]["stages"].items()}
    extra[f"{size}_step_ms"] = round(base[top]["step_ms"], 2)
    del engine
    vllm = run_vllm(
        args.vllm_python, model_dir, make_prompts(top, args.prompt, vocab, top), args.max_tokens, 0
    )
    if isinstance(vllm, dict):
        rows.append(
            {
                "model": size,
                "streams": top,
                "system": "vllm offline",
                "tok/s": vllm["tok_s"],
                "served/offline": None,
            }
        )
    else:
        extra["vllm"] = vllm
    cfg = cluster_config(f"serving-path-{size}-{os.getpid()}", model_dir, 1, engine_cfg)
    with Cluster(cfg) as cluster:
        served(cluster, "grpc", make_prompts(min(8, top), args.prompt, vocab, 98), 4)  # warm-up
        for n in args.streams:
            for api in ("http", "grpc"):
                prompts = make_prompts(n, args.prompt, vocab, n)
                r = served(cluster, api, prompts, args.max_tokens)
                rows.append(
                    {
                        "model": size,
                        "streams": n,
                        "system": api,
                        **r,
                        "served/offline": r["tok_s"] / base[n]["tok_s"],
                    }
                )
        extra[f"{size}_burst"] = burst_admission(
            cluster, args.burst, vocab, args.prompt, busy_streams=min(64, top)
        )


def fanout(args: argparse.Namespace) -> dict:
    """N workers behind one router (tiny model): the rate it forwards and its CPU share."""
    model_dir = build_tiny_model(None, "llama", "tiny", 0)
    n = args.fanout_workers * args.fanout_streams
    engine_cfg = engine_config(args.fanout_streams, args.prompt, args.max_tokens, 0)
    engine = Engine.from_model_dir(model_dir, EngineConfig(**engine_cfg))
    vocab = engine.executor.vocab_size
    one = offline(engine, make_prompts(args.fanout_streams, args.prompt, vocab, 7), args.max_tokens)
    del engine
    cfg = cluster_config(
        f"serving-path-fanout-{os.getpid()}", model_dir, args.fanout_workers, engine_cfg
    )
    with Cluster(cfg) as cluster:
        run_grpc(cluster.endpoints[0], make_prompts(8, args.prompt, vocab, 5), 4)
        cpu0, t0 = router_cpu(cluster), time.perf_counter()
        run = run_grpc(
            cluster.endpoints[0], make_prompts(n, args.prompt, vocab, 6), args.max_tokens
        )
        share = (router_cpu(cluster) - cpu0) / (time.perf_counter() - t0)
    assert run.tokens == n * args.max_tokens
    return {
        "workers": args.fanout_workers,
        "streams": n,
        "served_tok_s": round(run.tok_s, 1),
        "router_cpu_share": round(share, 3),
        "router_one_core_tok_s": round(run.tok_s / share, 1) if share > 0 else None,
        "workers_offline_tok_s": round(args.fanout_workers * one["tok_s"], 1),
    }


def plot(rows: list[dict]) -> Path:
    plt = pyplot()
    served_rows = [r for r in rows if r["system"] in ("http", "grpc")]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['model']}\n{r['streams']} {r['system']}" for r in served_rows]
    ax.bar(range(len(labels)), [r["served/offline"] for r in served_rows], color="tab:blue")
    ax.axhline(0.85, color="tab:red", linestyle="--", linewidth=1, label="0.85 target")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("served / offline tok/s")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, "serving_path.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["light", "32m"])
    parser.add_argument("--streams", nargs="+", type=int, default=[32, 128, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--burst", type=int, default=128)
    parser.add_argument("--fanout-workers", type=int, default=4)
    parser.add_argument("--fanout-streams", type=int, default=64, help="streams per worker")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few streams")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.streams, args.prompt, args.max_tokens = ["tiny"], [8], 32, 8
        args.burst, args.fanout_workers, args.fanout_streams = 16, 2, 4
    rows: list[dict] = []
    extra: dict = {}
    for size in args.models:
        bench_model(size, args, rows, extra)
    if args.fanout_workers:
        extra["fanout"] = fanout(args)
    cols = ["model", "streams", "system", "tok/s", "served/offline", "msgs/stream"]
    cols += ["worker lag ms", "router lag ms", "engine busy"]
    rows = [{c: "" if r.get(c) is None else r[c] for c in cols} for r in rows]
    print_table(rows, "served vs offline (same engine config; tok/s over all streams)")
    for key, value in extra.items():
        print(f"  {key}: {value}")
    png = plot(rows)
    print(f"  plot: {png}")
    headline: dict = {}
    for r in rows:
        if r["system"] in ("http", "grpc"):
            headline[f"{r['model']}_{r['system']}_{r['streams']}_ratio"] = round(
                r["served/offline"], 3
            )
    served_rows = [r for r in rows if r["system"] in ("http", "grpc")]
    for side in ("worker", "router"):
        lags = [r[f"{side} lag ms"] for r in served_rows if r[f"{side} lag ms"] != ""]
        headline[f"max_{side}_lag_ms"] = round(max(lags), 2) if lags else None
    headline.update({k: v for k, v in extra.items() if k.endswith("_burst") or k == "fanout"})
    emit_json(headline)
    return headline


if __name__ == "__main__":
    main()
