"""The serving path at engine speed: what a served worker delivers against its own engine
offline, on the same model, config and workload, in one run.

    python -m benchmarks.serving_path            # light + 32M models, 32/128/256 streams
    python -m benchmarks.serving_path --smoke    # tiny model, seconds
    python -m benchmarks.serving_path --smoke --models 32m   # the 32M model at smoke size
    python -m benchmarks.serving_path --models light --streams 128 256
    python -m benchmarks.serving_path --models 32m --streams 128 256 --fanout-workers 0
    python -m benchmarks.serving_path --models light --streams 128 256 --stream-interval 4
    python -m benchmarks.serving_path --models light --thread-sched   # threads' policy on

Workload: ``--streams`` prompts of ``--prompt`` random token ids, ``--max-tokens`` tokens
each (greedy, ``ignore_eos``), all at once. Systems:

* ``offline``: this engine in this process, every request added, stepped to the end;
* ``http``: a cluster of one worker and one router (``Cluster``), one SSE stream per prompt on
  ``/v1/completions`` (aiohttp, one asyncio loop);
* ``grpc``: the same cluster, one ``Generate`` stream per prompt (``grpc.aio``, one channel);
* ``vllm``: vLLM's CPU build in its own venv (``--vllm-python``), at the largest stream
  count: offline as ``engine_throughput`` runs it, and served (``vllm serve``, the same SSE
  client; ``benchmarks/vllm_serve.py``); skipped with a note when absent.

Reported per run: tok/s, served / offline, messages per stream (fewer than tokens when
coalesced), the largest event-loop stall of the worker and of the router during the run
(their loop-lag probes, with what the kernel runs each loop thread with: its slice and
niceness, ``cluster.scheduling``; ``--thread-sched`` turns that policy on, for an A/B;
``--trace-stalls`` splits the router's longest stalls into its loop's
own CPU, the collector's pauses and the time the OS kept the loop thread off a core, and
reports the largest stall less that wait), the engine thread's busy share, the share of the
run it spent runnable but without a core (``engine waits``: the kernel's schedstat; what
another process on the same cores takes from it), and CPU per token of the worker, the router
and the client (this process). The offline engine and the served worker run the same
intra-op threads (one per core this process may use) at the same niceness. Then: a burst of
``--burst`` requests arriving at a busy worker (time and engine steps until all are taken
in), the offline step split by stage (the engine's own stage timers), offline and served, and a
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

import ray

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.serving_probes import (
    burst_admission,
    cpu_times,
    engine_busy,
    loop_lags,
    own_lag_ms,
    router_cpu,
    runnable_wait,
    stage_seconds,
    stall_split,
    submit_calls,
)
from benchmarks.stream_clients import run_grpc, run_http
from benchmarks.vllm_bench import DEFAULT_VLLM_PYTHON
from benchmarks.vllm_serve import vllm_legs
from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from kvstore.requests.sampling_params import SamplingParams
from router.placement.config import STREAM_INTERVAL
from worker.engine import Engine, EngineConfig
from worker.model.build_tiny import build_tiny_model
from worker.model.thread_count import available_cores


def engine_config(
    streams: int, prompt: int, max_tokens: int, burst: int, threads: int | None = None
) -> dict:
    """One config for the offline engine and the served worker: the same intra-op threads
    too (a worker left to Ray's choice would run one per whole reserved CPU); ``threads``
    defaults to one per core this process may use."""
    per_seq = -(-(prompt + max_tokens) // 16)
    return {
        "cpu_threads": threads or available_cores(),
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
    """All prompts added, stepped to the end; tok/s, CPU per token and the engine's own
    per-stage step times (ms per step)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    tokens = 0
    stages0 = engine.snapshot().stage_seconds
    cpu0, wait0 = time.process_time(), runnable_wait()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        engine.drain_kv_events()  # as the worker does after every step
        tokens += sum(len(d.token_ids) for o in outs for d in o.outputs)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    stages = engine.snapshot().stage_seconds.minus(stages0)
    return {
        "tok_s": tokens / wall,
        "engine cpu ms/tok": 1e3 * cpu / tokens,
        "engine waits": (runnable_wait() - wait0) / wall,
        "tokens": tokens,
        "stages": {k: round(v, 2) for k, v in stages.per_step_ms().items()},
    }


def cluster_config(
    name: str,
    model_dir: Path,
    workers: int,
    engine: dict,
    stream_interval: int = STREAM_INTERVAL,
    sched: dict | None = None,
    log_stats: bool = True,
) -> ClusterConfig:
    """``log_stats``: the worker's and the router's (``benchmarks/metrics_cost.py``)."""
    router = {"port": 0, "http_port": 0, "stream_interval": stream_interval}
    return ClusterConfig.model_validate(
        {
            "name": name,
            "dashboard": False,
            "model": {"path": str(model_dir)},
            "workers": {
                "num_workers": workers,
                "num_cpus_per_worker": 0.1,
                "engine": {**engine, "log_stats": log_stats},
            },
            "router": {**router, "log_stats": log_stats},
            "scheduling": sched or {},
        }
    )


def served(
    cluster: Cluster, api: str, prompts: list[list[int]], max_tokens: int, trace: bool = False
) -> dict:
    """One served run: tok/s, messages, the loops' largest stalls (with ``trace``, each split
    into the loop's own time and its wait for a core), the engine's busy share."""
    loop_lags(cluster, reset=True, trace=trace)
    busy0 = engine_busy(cluster)
    cpu0 = cpu_times(cluster)
    stages0 = stage_seconds(cluster)
    submits0 = submit_calls(cluster)
    if api == "http":
        model = ray.get(
            next(iter(cluster.routers.values())).__ray_call__.remote(lambda r: r.settings.model_id)
        )
    t0, client0 = time.perf_counter(), time.process_time()
    if api == "http":
        run = run_http(cluster.http_endpoints[0], model, prompts, max_tokens)
    else:
        run = run_grpc(cluster.endpoints[0], prompts, max_tokens)
    wall, client = time.perf_counter() - t0, time.process_time() - client0
    lags = loop_lags(cluster, reset=False)
    busy1 = engine_busy(cluster)
    cpu1 = cpu_times(cluster)
    stages = stage_seconds(cluster)
    submits = submit_calls(cluster)
    expected = len(prompts) * max_tokens
    assert run.tokens == expected, f"{api}: {run.tokens} tokens, expected {expected}"
    return {
        "tok_s": run.tok_s,
        "msgs/stream": run.messages / len(prompts),
        "worker lag ms": lags["worker"],
        "router lag ms": lags["router"],
        "router own lag ms": own_lag_ms(lags["router_stalls"]) if "router_stalls" in lags else None,
        "router stalls": stall_split(lags.get("router_stalls", [])),
        "engine busy": None if busy0 is None or busy1 is None else (busy1 - busy0) / wall,
        **{f"{k} cpu ms/tok": 1e3 * (cpu1[k] - cpu0[k]) / run.tokens for k in CPU_SIDES},
        "engine waits": (cpu1["engine_wait"] - cpu0["engine_wait"]) / wall,
        "client cpu ms/tok": 1e3 * client / run.tokens,  # this process: the client's loop
        "submits/req": None if submits is None else (submits - submits0) / len(prompts),
        "stages": None
        if stages is None or stages0 is None
        else {k: round(v, 2) for k, v in stages.minus(stages0).per_step_ms().items()},
    }


CPU_SIDES = ("worker", "engine", "router")


def match_niceness(cluster: Cluster) -> int:
    """Run this process at the worker actors' niceness (Ray starts them niced): on a shared
    machine the offline engine and the clients then compete for the CPU as the served
    worker does."""
    h = next(iter(cluster.workers.values()))
    theirs = ray.get(h.__ray_call__.remote(lambda w: os.nice(0)))
    mine = os.nice(0)
    if theirs > mine:
        os.nice(theirs - mine)
    return theirs


def best(runs: list[dict]) -> dict:
    """The run of the highest tok/s (noise on a shared machine only ever slows a run)."""
    return max(runs, key=lambda r: r["tok_s"])


def thread_sched(args: argparse.Namespace) -> dict:
    """The cluster's ``scheduling`` section from ``--thread-sched`` / ``--compute-nice``."""
    sched: dict = {"enabled": args.thread_sched}
    if args.compute_nice is not None:
        sched["compute_nice"] = args.compute_nice
    return sched


def bench_model(size: str, args: argparse.Namespace, rows: list[dict], extra: dict) -> None:
    model_dir = build_tiny_model(None, "llama", size, 0)
    top = max(args.streams)
    engine_cfg = engine_config(top, args.prompt, args.max_tokens, args.burst, args.threads)
    name = f"serving-path-{size}-{os.getpid()}"
    cfg = cluster_config(name, model_dir, 1, engine_cfg, args.stream_interval, thread_sched(args))
    with Cluster(cfg) as cluster:
        if not args.smoke:  # (a test's process keeps its own priority)
            extra["niceness"] = match_niceness(cluster)
        lags = loop_lags(cluster, reset=False)  # which loop Ray gave the actors (uvloop's?)
        extra[f"{size}_loops"] = {
            **{side: lags.get(f"{side}_loop") for side in ("worker", "router")},
            **{
                f"{side}_sched": lags.get(f"{side}_sched")
                for side in ("worker", "router", "engine")
            },
        }
        engine = Engine.from_model_dir(model_dir, EngineConfig(**engine_cfg))
        vocab = engine.executor.vocab_size
        offline(engine, make_prompts(min(8, top), args.prompt, vocab, 99), 4)  # warm-up
        served(cluster, "grpc", make_prompts(min(8, top), args.prompt, vocab, 98), 4)
        for n in args.streams:
            runs: dict[str, list[dict]] = {"offline": [], "http": [], "grpc": []}
            for rep in range(args.repeat):  # interleaved: a load spike hits every system
                prompts = make_prompts(n, args.prompt, vocab, 1000 * rep + n)
                runs["offline"].append(offline(engine, prompts, args.max_tokens))
                for api in ("http", "grpc"):
                    run = served(cluster, api, prompts, args.max_tokens, args.trace_stalls)
                    runs[api].append(run)
            base = best(runs["offline"])
            rows.append(
                {"model": size, "streams": n, "system": "offline", **base, "served/offline": 1.0}
            )
            for api in ("http", "grpc"):
                r = best(runs[api])
                rows.append(
                    {
                        "model": size,
                        "streams": n,
                        "system": api,
                        **r,
                        "served/offline": r["tok_s"] / base["tok_s"],
                        # the offline engine's CPU per token over the served worker's: what
                        # the ratio would be with a core for each process
                        "cpu ratio": base["engine cpu ms/tok"] / r["worker cpu ms/tok"],
                    }
                )
            for api in ("http", "grpc"):
                if args.trace_stalls:
                    extra[f"{size}_{api}_{n}_router_stalls"] = best(runs[api])["router stalls"]
            if n == top:  # the engine's step, offline and served (ms per step by stage)
                extra[f"{size}_stages_offline"] = base["stages"]
                extra[f"{size}_stages_served"] = best(runs["grpc"])["stages"]
        del engine
        extra[f"{size}_burst"] = burst_admission(
            cluster, args.burst, vocab, args.prompt, busy_streams=min(64, top)
        )
    offline_v, served_v, notes = vllm_legs(
        args.vllm_python,
        model_dir,
        make_prompts(top, args.prompt, vocab, top),
        args.max_tokens,
        engine_cfg["max_model_len"],
    )
    vllm_row = {"model": size, "streams": top, "served/offline": 1.0}
    if offline_v is not None:
        rows.append({**vllm_row, "system": "vllm offline", "tok_s": offline_v["tok_s"]})
    if offline_v is not None and served_v is not None:
        ratio = served_v["tok_s"] / offline_v["tok_s"]
        rows.append({**vllm_row, "system": "vllm http", **served_v, "served/offline": ratio})
    if notes:
        extra[f"{size}_vllm"] = "; ".join(notes)


def fanout(args: argparse.Namespace) -> dict:
    """N workers behind one router (tiny model): the rate it forwards and its CPU share."""
    model_dir = build_tiny_model(None, "llama", "tiny", 0)
    n = args.fanout_workers * args.fanout_streams
    engine_cfg = engine_config(args.fanout_streams, args.prompt, args.max_tokens, 0)
    engine_cfg["cpu_threads"] = 1  # the workers share the node's cores
    engine = Engine.from_model_dir(model_dir, EngineConfig(**engine_cfg))
    vocab = engine.executor.vocab_size
    one = offline(engine, make_prompts(args.fanout_streams, args.prompt, vocab, 7), args.max_tokens)
    del engine
    cfg = cluster_config(
        f"serving-path-fanout-{os.getpid()}",
        model_dir,
        args.fanout_workers,
        engine_cfg,
        sched=thread_sched(args),
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
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [r["served/offline"] for r in served_rows], 0.4, label="tok/s")
    cpu = [r["cpu ratio"] for r in served_rows]
    ax.bar([i + 0.2 for i in x], cpu, 0.4, label="CPU per token", color="tab:green")
    ax.axhline(0.85, color="tab:red", linestyle="--", linewidth=1, label="0.85 target")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("served / offline tok/s")
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, "serving_path.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=None, help="default: light 32m (--smoke: tiny)"
    )
    parser.add_argument("--streams", nargs="+", type=int, default=[32, 128, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--burst", type=int, default=128)
    parser.add_argument("--fanout-workers", type=int, default=4)
    parser.add_argument("--fanout-streams", type=int, default=64, help="streams per worker")
    parser.add_argument("--repeat", type=int, default=2, help="runs per system (best kept)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the engine's intra-op threads, offline and served (default: one per core)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=STREAM_INTERVAL,
        help="the router's stream_interval: steps' tokens per client message at least",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few streams")
    parser.add_argument(
        "--thread-sched",
        action="store_true",
        help="short slices for the loops (scheduling.enabled: true; off by default; A/B)",
    )
    parser.add_argument(
        "--compute-nice",
        type=int,
        default=None,
        help="scheduling.compute_nice of the served worker (default: the config's)",
    )
    parser.add_argument(
        "--trace-stalls",
        action="store_true",
        help="split each loop stall into its own CPU, GC and run-queue wait (a watchdog thread)",
    )
    args = parser.parse_args(argv)
    if args.smoke:  # (a model named with --smoke runs at smoke size too)
        args.models = args.models or ["tiny"]
        args.streams, args.prompt, args.max_tokens = [8], 32, 8
        args.burst, args.fanout_workers, args.fanout_streams, args.repeat = 16, 2, 4, 1
    args.models = args.models or ["light", "32m"]
    rows: list[dict] = []
    extra: dict = {}
    for size in args.models:
        bench_model(size, args, rows, extra)
    if args.fanout_workers:
        extra["fanout"] = fanout(args)
    cols = ["model", "streams", "system", "tok_s", "served/offline", "msgs/stream"]
    cols += ["worker lag ms", "router lag ms", "router own lag ms", "engine busy", "engine waits"]
    cols += ["engine cpu ms/tok", "worker cpu ms/tok", "router cpu ms/tok", "client cpu ms/tok"]
    cols += ["cpu ratio", "submits/req"]
    rows = [{c: "" if r.get(c) is None else r[c] for c in cols} for r in rows]
    print_table(rows, "served vs offline (same engine config; tok/s over all streams)")
    for key, value in extra.items():
        print(f"  {key}: {value}")
    png = plot(rows)
    print(f"  plot: {png}")
    headline: dict = {"stream_interval": args.stream_interval}
    for r in rows:
        if r["system"] == "vllm http":
            headline[f"{r['model']}_vllm_http_{r['streams']}_ratio"] = round(r["served/offline"], 3)
        if r["system"] in ("http", "grpc"):
            key = f"{r['model']}_{r['system']}_{r['streams']}"
            headline[f"{key}_ratio"] = round(r["served/offline"], 3)
            headline[f"{key}_cpu_ratio"] = round(r["cpu ratio"], 3)
            headline[f"{key}_router_cpu_ms_tok"] = round(r["router cpu ms/tok"], 3)
            headline[f"{key}_engine_waits"] = round(r["engine waits"], 3)
            if r["submits/req"] != "":
                headline[f"{key}_submits_per_req"] = round(r["submits/req"], 3)
    served_rows = [r for r in rows if r["system"] in ("http", "grpc")]
    for side in ("worker", "router"):
        lags = [r[f"{side} lag ms"] for r in served_rows if r[f"{side} lag ms"] != ""]
        headline[f"max_{side}_lag_ms"] = round(max(lags), 2) if lags else None
    own = [r["router own lag ms"] for r in served_rows if r["router own lag ms"] != ""]
    if own:  # (--trace-stalls) the largest router stall less its wait for a core
        headline["max_router_own_lag_ms"] = round(max(own), 2)
    headline.update(
        {k: v for k, v in extra.items() if k.endswith(("_burst", "_loops")) or k == "fanout"}
    )
    emit_json(headline)
    return headline


if __name__ == "__main__":
    main()
