"""What measuring for metrics costs the serving path: the workload of ``serving_path`` served
by one worker and one router with ``log_stats`` on and off (``workers.engine.log_stats``,
``router.log_stats``: every per-request and per-output measurement, vLLM's
``--disable-log-stats``), side by side in one run.

    python -m benchmarks.metrics_cost --smoke
    python -m benchmarks.metrics_cost --models light --streams 128 256 --repeat 3

Each repeat starts a cluster per setting, in alternating order (on, off, then off, on), so a
load drift on the machine hits both alike; each cluster serves every stream count over HTTP
and gRPC. Reported per setting: tok/s (the best run) and CPU per token of the worker process,
its engine thread and the router process (the least over the repeats: noise only adds CPU),
and on / off: the measuring's share of each side's CPU per token. Table, one JSON line.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import emit_json, print_table
from benchmarks.serving_path import cluster_config, engine_config, make_prompts, served
from cluster.launcher import Cluster
from worker.model.build_tiny import build_tiny_model

SIDES = ("worker", "engine", "router")
APIS = ("http", "grpc")
VOCAB = 256  # prompt ids below every tiny model's vocabulary


def run_setting(args: argparse.Namespace, size: str, log_stats: bool, runs: dict) -> None:
    """One cluster with ``log_stats`` on or off: every stream count over both APIs."""
    model_dir = build_tiny_model(None, "llama", size, 0)
    engine_cfg = engine_config(max(args.streams), args.prompt, args.max_tokens, 0, args.threads)
    name = f"metrics-cost-{size}-{int(log_stats)}-{os.getpid()}"
    cfg = cluster_config(name, model_dir, 1, engine_cfg, log_stats=log_stats)
    with Cluster(cfg) as cluster:
        served(cluster, "grpc", make_prompts(8, args.prompt, VOCAB, 98), 4)  # warm-up
        for n in args.streams:
            prompts = make_prompts(n, args.prompt, VOCAB, n)  # the same for both settings
            for api in APIS:
                run = served(cluster, api, prompts, args.max_tokens)
                runs.setdefault((size, n, api, log_stats), []).append(run)


def summary(runs: list[dict]) -> dict:
    return {
        "tok_s": max(r["tok_s"] for r in runs),
        **{f"{s} cpu ms/tok": min(r[f"{s} cpu ms/tok"] for r in runs) for s in SIDES},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["light"])
    parser.add_argument("--streams", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="clusters per setting")
    parser.add_argument(
        "--threads", type=int, default=None, help="the engine's intra-op threads (one per core)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few streams")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.streams, args.prompt, args.max_tokens = ["tiny"], [8], 32, 8
        args.repeat = 1
    runs: dict = {}
    for size in args.models:
        for rep in range(args.repeat):
            for log_stats in (True, False) if rep % 2 == 0 else (False, True):
                run_setting(args, size, log_stats, runs)
    rows, headline = [], {}
    for size in args.models:
        for n in args.streams:
            for api in APIS:
                on, off = (summary(runs[(size, n, api, s)]) for s in (True, False))
                for label, fig in (("on", on), ("off", off)):
                    rows.append({"model": size, "streams": n, "api": api, "log_stats": label})
                    rows[-1].update({k: round(v, 4) for k, v in fig.items()})
                key = f"{size}_{api}_{n}"
                for s in SIDES:
                    ratio = on[f"{s} cpu ms/tok"] / off[f"{s} cpu ms/tok"]
                    rows[-2][f"{s} on/off"] = rows[-1][f"{s} on/off"] = round(ratio, 3)
                    headline[f"{key}_{s}_cpu_on_off"] = round(ratio, 3)
                headline[f"{key}_tok_s_on_off"] = round(on["tok_s"] / off["tok_s"], 3)
    print_table(rows, "log_stats on vs off (CPU per token: least over repeats; tok/s: best)")
    emit_json(headline)
    return headline


if __name__ == "__main__":
    main()
