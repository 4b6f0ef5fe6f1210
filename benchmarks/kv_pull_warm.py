"""Warm start on a real cluster: how fast a worker added to a warm fleet reaches the fleet's
median hit rate, with pulls on (the routers have it warm-start from its peers by itself)
and without.

Two clusters (in-process Ray, local redis-server, ``--fleet`` tiny CPU workers each; one
with ``router.routing.pull`` on and ``warm_start_prefixes=--hot``, one without pulls)
serve the same stream: ``--warm-requests`` over ``--prefixes`` shared prefixes (Zipf
popularity, a short distinct tail each), round-robin over the fleet. Then
``Cluster.add_worker()`` adds a worker — nothing else: with pulls on, a router sees its
heartbeat and asks it to warm-start — and the next ``--requests`` of the stream go to the
new worker, then to each fleet worker (direct calls, so every hit rate is exact). "Reached"
is the first request after which the new worker's hit rate over the last ``--window``
requests is at least the fleet's median. Target: at least 3x sooner with pulls.

    .venv/bin/python -m benchmarks.kv_pull_warm            # about a minute
    .venv/bin/python -m benchmarks.kv_pull_warm --smoke
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from cluster.config import ClusterConfig
from kvstore.blocks.outputs import OUTPUT_SCHEMA, unpack_output
from kvstore.blocks.protocol import WorkerRequest
from kvstore.blocks.sampling_params import SamplingParams

TARGET_SPEEDUP = 3.0
PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _stream(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(5, vocab) for _ in range(args.prefix)] for _ in range(args.prefixes)]
    weights = [1.0 / (i + 1) for i in range(args.prefixes)]
    picks = rng.choices(range(args.prefixes), weights, k=args.warm_requests + args.requests)
    return [prefixes[i] + [rng.randrange(5, vocab) for _ in range(8)] for i in picks]


def _config(args: argparse.Namespace, pull: bool) -> ClusterConfig:
    engine = {"num_blocks": args.blocks, "block_size": 16, "max_model_len": args.prefix + 64}
    pull_cfg = {"enabled": pull, "warm_start_prefixes": args.hot}
    return ClusterConfig.model_validate(
        {
            "name": f"bench-warm-{'pull' if pull else 'nopull'}-{os.getpid()}",
            "dashboard": False,
            "model": {"tiny_family": "llama"},
            "workers": {"num_workers": args.fleet, "num_cpus_per_worker": 0.1, "engine": engine},
            "router": {"port": 0, "http_port": None, "routing": {"pull": pull_cfg}},
        }
    )


def _hits(handle, prompts: list[list[int]], tag: str) -> list[float]:  # noqa: ANN001
    """Per request, the share of its prompt served from the worker's cache."""
    import ray

    out = []
    for i, p in enumerate(prompts):
        req = WorkerRequest(f"{tag}-{i}", p, PARAMS)
        channel_id = f"bench/{req.request_id}"  # a channel of its own, read to its end
        batches = handle.outputs.options(num_returns="streaming").remote(
            channel_id, None, OUTPUT_SCHEMA
        )
        ray.get(handle.submit.remote(req, None, channel_id))
        last = None
        for ref in batches:
            outs = [unpack_output(item) for item in ray.get(ref)]
            last = outs[-1]
            if last.finished:
                break
        assert last is not None and last.finished
        out.append(last.usage.cached_tokens / len(p))
    return out


def _reached(hits: list[float], fleet: float, window: int) -> int:
    """Requests served until the hit rate over the last ``window`` is >= ``fleet``."""
    for i in range(window, len(hits) + 1):
        if sum(hits[i - window : i]) / window >= fleet - 1e-9:
            return i
    return len(hits) + 1  # never, within the run


def _run(args: argparse.Namespace, pull: bool) -> dict:
    import ray

    from cluster.launcher import Cluster  # late: imports Ray and the worker's model code
    from worker.model.config import ModelConfig

    with Cluster(_config(args, pull)) as cluster:
        stream = _stream(args, ModelConfig.from_dir(cluster.model_dir).vocab_size)
        fleet = [cluster.workers[w] for w in sorted(cluster.workers)]
        for i, p in enumerate(stream[: args.warm_requests]):
            _hits(fleet[i % len(fleet)], [p], f"warm{i}")
        t0 = time.monotonic()
        new = cluster.workers[cluster.add_worker()]
        ready_s = time.monotonic() - t0
        warm_s = 0.0
        if pull:  # the router starts it; wait for it here so the count starts after it
            while not ray.get(new.pull_stats.remote())["warm_started"]:
                assert time.monotonic() - t0 < 120, "no warm start within 120 s"
                time.sleep(0.05)
            warm_s = time.monotonic() - t0 - ready_s
        stats = ray.get(new.pull_stats.remote())
        later = stream[args.warm_requests :]
        new_hits = _hits(new, later, "new")
        fleet_rates = [statistics.fmean(_hits(w, later, f"f{i}")) for i, w in enumerate(fleet)]
    return {
        "hits": new_hits,
        "fleet": statistics.median(fleet_rates),
        "warmed_blocks": stats["warmed_blocks"],
        "ready_s": ready_s,
        "warm_s": warm_s,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fleet", type=int, default=2, help="workers before one is added")
    ap.add_argument("--prefixes", type=int, default=24)
    ap.add_argument("--prefix", type=int, default=256, help="tokens per shared prefix")
    ap.add_argument("--warm-requests", type=int, default=200)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--hot", type=int, default=12, help="router.routing.pull.warm_start_prefixes")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=512, help="KV blocks per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prefixes, args.prefix, args.warm_requests, args.requests = 8, 64, 40, 40
        args.hot, args.window = 4, 5
    cold, warm = _run(args, pull=False), _run(args, pull=True)
    r_cold = _reached(cold["hits"], cold["fleet"], args.window)
    r_warm = _reached(warm["hits"], warm["fleet"], args.window)
    rows = [
        {"worker": "fleet (median)", "hit_rate": warm["fleet"], "reached_after": 0},
        {"worker": "added, no pulls", "hit_rate": statistics.fmean(cold["hits"]),
         "reached_after": r_cold},
        {"worker": "added, warm start", "hit_rate": statistics.fmean(warm["hits"]),
         "reached_after": r_warm},
    ]  # fmt: skip
    print_table(rows, f"warm start: {args.hot} hottest of {args.prefixes} prefixes pulled")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    w = args.window
    for name, hits in (("no pulls", cold["hits"]), ("warm start", warm["hits"])):
        ax.plot(
            [sum(hits[max(0, i - w) : i]) / min(i, w) for i in range(1, len(hits) + 1)], label=name
        )
    ax.axhline(warm["fleet"], color="gray", ls=":", label="fleet median")
    ax.set_xlabel("requests served by the added worker")
    ax.set_ylabel(f"hit rate, last {w}")
    ax.legend()
    save_figure(fig, "kv_pull_warm.png")
    speedup = r_cold / max(r_warm, 1)
    head = {
        "benchmark": "kv_pull_warm",
        "smoke": args.smoke,
        "fleet_hit_rate": round(warm["fleet"], 4),
        "reached_cold_requests": r_cold,
        "reached_warm_requests": r_warm,
        "warm_speedup": round(speedup, 2),
        "pulled_blocks": warm["warmed_blocks"],
        "warm_start_s": round(warm["warm_s"], 3),
        "target_met": speedup >= TARGET_SPEEDUP,
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
