"""Peer pulls on a real local cluster: least_loaded and prefix_affinity, each with and
without pulls, at three offered loads.

Each of the four configurations gets a fresh cluster (in-process Ray, local redis-server,
``--workers`` CPU workers, the same engine sizes) and serves the same seeded workload at
each concurrency of ``--loads`` in turn: ``--groups`` system prompts of ``--prefix-words``
words each plus a distinct question — a hot prefix set about ``--hot-x`` times one
worker's KV cache, so no worker can hold it all and where a request lands (and whether its
prefix can be pulled) decides what is recomputed. Reports req/s, TTFT and hit rate per
load, failures (must be 0), the ratios with / without pulls, and saves
``kv_pull_cluster.png``. Sized for a 2-core machine: timings move with other jobs, so the
lead re-runs it on a quiet machine.

    .venv/bin/python -m benchmarks.kv_pull_cluster            # 32M model, many minutes
    .venv/bin/python -m benchmarks.kv_pull_cluster --smoke    # tiny model, a few minutes
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
PRICED = ("hold", "pull", "recompute", "local", "pending", "cold")  # PullPlanner's choices
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
                "pull_taken_ms",
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
                    "pull_ms": round(pulls.get("pull_taken_ms", 0) / n_pulls),
                    "priced_ms": round(pulls.get("pull_priced_ms", 0) / n_pulls),
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
    ap.add_argument("--loads", default="4,8,16", help="concurrencies, up to saturation")
    ap.add_argument("--warmup", type=int, default=32, help="requests before measuring")
    ap.add_argument(
        "--zipf", type=float, default=0.0, help="popularity skew of the prefixes (0: uniform)"
    )
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", choices=sorted({p for p, _ in CONFIGS}), help="one policy")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.workers, args.blocks, args.groups = "tiny", 2, 32, 4
        args.prefix_words, args.requests, args.loads, args.warmup = 120, 8, "2,4", 4
    args.loads = [int(x) for x in str(args.loads).split(",")]
    configs = [c for c in CONFIGS if args.only is None or c[0] == args.only]
    rows = [r for policy, pull in configs for r in _run(policy, pull, args)]
    print_table(rows, f"peer pulls, {args.workers} workers, {args.size} model")
    if args.only:
        return {}
    _plot(rows, args.loads)
    by = {(r["policy"], r["pull"], r["concurrency"]): r for r in rows}
    top = max(args.loads)
    ll = by[("least_loaded", "on", top)]["req_s"] / by[("least_loaded", "off", top)]["req_s"]
    aff = [
        by[("prefix_affinity", "on", c)]["req_s"] / by[("prefix_affinity", "off", c)]["req_s"]
        for c in args.loads
    ]
    head = {
        "benchmark": "kv_pull_cluster",
        "smoke": args.smoke,
        "least_loaded_pull_req_s_ratio": round(ll, 3),
        "affinity_pull_req_s_ratios": [round(x, 3) for x in aff],
        "affinity_pull_p99_ttft_ratio_top": round(
            by[("prefix_affinity", "on", top)]["ttft_p99_s"]
            / by[("prefix_affinity", "off", top)]["ttft_p99_s"],
            3,
        ),
        "hit_rate_least_loaded_pull_top": round(by[("least_loaded", "on", top)]["hit_rate"], 3),
        "hit_rate_least_loaded_top": round(by[("least_loaded", "off", top)]["hit_rate"], 3),
        "failures": sum(r["failed"] for r in rows),
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
