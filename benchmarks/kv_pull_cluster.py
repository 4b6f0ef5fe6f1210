"""Peer pulls on a real local cluster: least_loaded and prefix_affinity, each with and
without pulls, at three offered loads up to saturation.

Each of the four configurations gets a fresh cluster (in-process Ray, local redis-server,
``--workers`` CPU workers, the same engine sizes) and serves one seeded stream of requests:
``--groups`` system prompts of ``--prefix-words`` words each plus a distinct question — by
default a hot prefix set 2.5 times one worker's KV cache (6 x ~1,020 tokens, 152 blocks of
16; ``hot_set_x`` in the JSON line), so no worker can hold it all
and where a request lands (and whether its prefix can be pulled) decides what is
recomputed. System prompts are drawn uniformly, or Zipf-skewed with ``--zipf S`` (the
``r``-th with weight ``1/(r+1)^S``; reported in the JSON line). Every configuration's
workers admit the same way: cache-aware admission by default, ``--admission strict`` for
plain policy order.

First a **warm-up** of ``--warmup`` requests at the lowest load, not measured: the cluster
starts cold, and the first touch of each prefix (which nothing can pull) is not what is
measured. Then ``--requests`` requests at each concurrency of ``--loads`` in turn (closed
loop: ``concurrency`` requests in flight), each load with questions of its own; the top
load is past saturation for every configuration (req/s flattens). Reports req/s, TTFT and
hit rate per load, the fleet's **coverage** of the hot set (the share of its blocks held
somewhere, sampled from the index while the load runs) and its copies per block, failures
(must be 0), the pulls and their outcomes, their priced and taken time, the router's
choices (hold / pull / recompute, a pull backed off: busy, full, or no pull to price:
local, pending, cold) and the placements whose realised hit missed the prediction (of
them, pull_evicted: pulled ones whose import landed); the ratios with / without pulls, and
``kv_pull_cluster.png``. Sized for a 2-core machine (about 6 minutes): timings move with
other jobs, so compare configurations within one run and re-run on a quiet machine;
``--repeat N`` runs every configuration N times in alternating order (forward, then
backward) and keeps each cell's run of the highest req/s, so a drift of the machine's
speed during the run does not land on one configuration.

    .venv/bin/python -m benchmarks.kv_pull_cluster                # 32M model, ~10 min
    .venv/bin/python -m benchmarks.kv_pull_cluster --zipf 1.0     # skewed popularity
    .venv/bin/python -m benchmarks.kv_pull_cluster --smoke        # tiny model, a few minutes
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.kv_coverage import CoverageSampler, prefix_keys
from benchmarks.loadgen import make_prefixes, make_prompts, send_all, summarize
from benchmarks.policy_bench import Workload, cluster_config
from cluster.client import KVClusterClient
from cluster.config import ClusterConfig

OUTCOMES = ("ok", "missing", "source-gone", "timeout", "refused")  # PeerPulls' outcomes
# PullPlanner's choices
PRICED = ("hold", "pull", "recompute", "busy", "full", "local", "pending", "cold")
CONFIGS = (
    ("least_loaded", False),
    ("least_loaded", True),
    ("prefix_affinity", False),
    ("prefix_affinity", True),
)


def _config(policy: str, pull: bool, args: argparse.Namespace) -> ClusterConfig:
    w = Workload(
        model_size=args.size,
        num_requests=args.requests,
        concurrency=1,
        num_groups=args.groups,
        prefix_words=args.prefix_words,
        max_tokens=args.max_tokens,
        num_blocks=args.blocks,
        num_workers=args.workers,
    )
    raw = cluster_config(policy, w).model_dump()
    raw["name"] = f"{raw['name']}-{'pull' if pull else 'nopull'}"
    raw["router"]["routing"]["pull"] = {"enabled": pull}
    # the same worker scheduling in all four configurations
    raw["workers"]["engine"]["cache_aware_admission"] = args.admission == "cache-aware"
    return ClusterConfig.model_validate(raw)


def _pull_counters(cluster) -> dict[str, int]:  # noqa: ANN001
    """The routers' pulled column and the workers' pull outcomes, summed (cumulative)."""
    import ray

    out: dict[str, int] = {}
    for h in cluster.routers.values():
        for k, v in ray.get(h.stats.remote(), timeout=30).items():
            if k in (
                "pulls",
                "pulled_tokens",
                "pull_misses",
                "pull_slow",
                "pull_evicted",
                "pull_time_priced_ms",
                "pull_time_taken_ms",
                "prediction_placements",
                "prediction_misses",
            ) or k.startswith("pull_priced_"):
                out[k] = out.get(k, 0) + v
    for h in cluster.workers.values():
        for k, v in ray.get(h.pull_stats.remote(), timeout=30)["outcomes"].items():
            out[f"pull_{k}"] = out.get(f"pull_{k}", 0) + v
    return out


def _phases(args: argparse.Namespace) -> list[list[str]]:
    """The warm-up's prompts, then each load's: one seeded stream of the same system
    prompts, so every phase asks for the same hot set with questions of its own."""
    sizes = [args.warmup] + [args.requests] * len(args.loads)
    prompts = make_prompts(sum(sizes), args.groups, args.prefix_words, args.seed, zipf=args.zipf)
    out, at = [], 0
    for n in sizes:
        out.append(prompts[at : at + n])
        at += n
    return out


def _run(policy: str, pull: bool, args: argparse.Namespace) -> list[dict]:
    from cluster.launcher import Cluster  # late: imports Ray and the worker's model code
    from kvstore.index import KVIndex

    warmup, *phases = _phases(args)
    rows = []
    with (
        Cluster(_config(policy, pull, args)) as cluster,
        KVClusterClient(cluster.endpoints[0]) as client,
    ):
        index_cfg = cluster.index_config()
        assert index_cfg is not None  # the embedded redis-server
        keys = prefix_keys(
            client, make_prefixes(args.groups, args.prefix_words, args.seed), cluster.model_id, 16
        )
        coverage = CoverageSampler(KVIndex(index_cfg), keys)
        args.hot_set_x = sum(len(k) for k in keys) / args.blocks
        # warm-up, not measured: every worker has cached what its policy sends it, so each
        # load measures the steady state, not the first touch of each prefix
        send_all(client, warmup, concurrency=min(args.loads), max_tokens=args.max_tokens)
        before = _pull_counters(cluster)
        for load, prompts in zip(args.loads, phases, strict=True):
            coverage.start()
            samples, wall = send_all(
                client, prompts, concurrency=load, max_tokens=args.max_tokens, progress=sys.stderr
            )
            held, copies = coverage.stop()
            s = summarize(samples, wall)
            now = _pull_counters(cluster)
            pulls = {k: v - before.get(k, 0) for k, v in now.items()}
            before = now
            n_pulls = max(pulls.get("pulls", 0), 1)
            rows.append(
                {
                    "policy": policy,
                    "pull": "on" if pull else "off",
                    "concurrency": load,
                    "ok": s["ok"],
                    "failed": len(samples) - s["ok"],
                    "req_s": s["req_s"],
                    "ttft_p50_s": s["ttft_p50_s"],
                    "ttft_p99_s": s["ttft_p99_s"],
                    "hit_rate": s["hit_rate"],
                    "coverage": held,
                    "copies": copies,
                    "errors": ",".join(sorted({x.code for x in samples if not x.ok})) or "-",
                    "pulls": pulls.get("pulls", 0),
                    "pulled_tok": pulls.get("pulled_tokens", 0),
                    "outcomes": ",".join(
                        f"{k[5:]}:{v}"
                        for k, v in sorted(pulls.items())
                        if k.startswith("pull_") and k[5:] in OUTCOMES and v
                    )
                    or "-",
                    "pull_slow": pulls.get("pull_slow", 0),
                    # pulled placements whose import landed and whose hit still missed
                    "pull_evicted": pulls.get("pull_evicted", 0),
                    # placements whose realised hit missed the router's prediction by a block
                    "missed": pulls.get("prediction_misses", 0),
                    "pull_ms": round(pulls.get("pull_time_taken_ms", 0) / n_pulls),
                    "priced_ms": round(pulls.get("pull_time_priced_ms", 0) / n_pulls),
                    "priced": "/".join(str(pulls.get(f"pull_priced_{c}", 0)) for c in PRICED),
                }
            )
    return rows


def _plot(rows: list[dict], loads: list[int]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy, pull in CONFIGS:
        mine = [r for r in rows if r["policy"] == policy and r["pull"] == ("on" if pull else "off")]
        label = f"{policy}{' + pull' if pull else ''}"
        axes[0].plot(loads, [r["req_s"] for r in mine], "o-", label=label)
        axes[1].plot(loads, [r["ttft_p99_s"] for r in mine], "o-", label=label)
    axes[0].set_title("req/s")
    axes[1].set_title("TTFT p99 (s)")
    for ax in axes:
        ax.set_xlabel("concurrency (offered load)")
        ax.legend()
    save_figure(fig, "kv_pull_cluster.png")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="32m", help="offline model size (build_tiny SIZES)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=152, help="KV blocks per worker (16 tokens)")
    ap.add_argument("--groups", type=int, default=6, help="system prompts (the hot set)")
    ap.add_argument("--prefix-words", type=int, default=420, help="~2.4 tokens each (32m)")
    ap.add_argument("--requests", type=int, default=96, help="requests per load")
    ap.add_argument("--loads", default="4,16,32", help="concurrencies, past saturation")
    ap.add_argument("--warmup", type=int, default=32, help="requests before measuring")
    ap.add_argument(
        "--zipf", type=float, default=0.0, help="popularity skew of the prefixes (0: uniform)"
    )
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument(
        "--admission",
        choices=("cache-aware", "strict"),
        default="cache-aware",
        help="every worker's admission order (EngineConfig.cache_aware_admission)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every configuration, in alternating order; each cell keeps its run "
        "of the highest req/s (a slower machine only ever lowers a run)",
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", choices=sorted({p for p, _ in CONFIGS}), help="one policy")
    ap.add_argument("--pull", choices=("on", "off"), help="with --only: pulls on or off only")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.workers, args.blocks, args.groups = "tiny", 2, 32, 4
        args.prefix_words, args.requests, args.loads, args.warmup = 120, 8, "2,4", 4
    args.loads = [int(x) for x in str(args.loads).split(",")]
    configs = [
        (policy, pull)
        for policy, pull in CONFIGS
        if args.only in (None, policy) and args.pull in (None, "on" if pull else "off")
    ]
    runs: dict[tuple, list[dict]] = {}
    for rep in range(max(args.repeat, 1)):
        for policy, pull in configs if rep % 2 == 0 else configs[::-1]:
            for r in _run(policy, pull, args):
                runs.setdefault((policy, r["pull"], r["concurrency"]), []).append(r)
    rows = [max(cell, key=lambda r: r["req_s"]) for cell in runs.values()]
    rows.sort(key=lambda r: (configs.index((r["policy"], r["pull"] == "on")), r["concurrency"]))
    failures = sum(r["failed"] for cell in runs.values() for r in cell)
    print_table(rows, f"peer pulls, {args.workers} workers, {args.size} model")
    if args.only or args.pull:  # a diagnostic subset: no ratios
        return {}
    _plot(rows, args.loads)
    by = {(r["policy"], r["pull"], r["concurrency"]): r for r in rows}
    top = max(args.loads)

    def per_load(policy: str, pull: str, key: str = "req_s") -> list[float]:
        return [round(by[(policy, pull, c)][key], 3) for c in args.loads]

    def ratios(policy: str, key: str = "req_s") -> list[float]:
        on, off = per_load(policy, "on", key), per_load(policy, "off", key)
        return [round(a / b, 3) if b else float("nan") for a, b in zip(on, off, strict=True)]

    head = {
        "benchmark": "kv_pull_cluster",
        "smoke": args.smoke,
        "zipf": args.zipf,
        "admission": args.admission,
        "hot_set_x": round(args.hot_set_x, 2),
        "loads": args.loads,
        "requests_per_load": args.requests,
        "req_s_least_loaded": per_load("least_loaded", "off"),
        "req_s_least_loaded_pull": per_load("least_loaded", "on"),
        "req_s_affinity": per_load("prefix_affinity", "off"),
        "req_s_affinity_pull": per_load("prefix_affinity", "on"),
        "least_loaded_pull_req_s_ratios": ratios("least_loaded"),
        "least_loaded_pull_req_s_ratio": ratios("least_loaded")[-1],
        "affinity_pull_req_s_ratios": ratios("prefix_affinity"),
        "affinity_pull_p99_ttft_ratio_top": ratios("prefix_affinity", "ttft_p99_s")[-1],
        "hit_rate_least_loaded_pull_top": round(by[("least_loaded", "on", top)]["hit_rate"], 3),
        "hit_rate_least_loaded_top": round(by[("least_loaded", "off", top)]["hit_rate"], 3),
        "repeat": args.repeat,
        "failures": failures,  # over every run, kept or not
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
