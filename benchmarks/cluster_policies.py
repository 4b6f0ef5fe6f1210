"""Routing policies compared on one shared-prefix workload: round_robin, least_loaded,
prefix_affinity.

For each policy a fresh local cluster (in-process Ray, local redis-server, 2 CPU workers,
same config except ``router.routing.policy``) serves the same seeded workloads, cold (nothing
warmed): ``num_groups`` system prompts of ``prefix_words`` words, each request one of them
plus a distinct question, ``concurrency`` in flight. Prefill dominates as in real serving:
the 100m-parameter offline model, long system prompts, short answers, and more distinct
system prompts than one worker's KV cache holds (but not more than the cluster's), so where a
request lands decides whether its prefix is recomputed. Each cluster serves three prompt
seeds in turn (``--seeds``, default 0,1,2); seeds share no system prompt, so each starts
cache-cold. The figures pool the seeds, so the TTFT ratio is the ratio of the seed means;
the per-seed ratios are printed and in the JSON line. One seed's 64 requests are not enough
to judge on: the first burst of 8 (4 system prompts, nothing cached, no KV event yet) costs
a large share of the mean, and where it lands varies with arrival order.

Prints one table (TTFT mean/p50/p99, req/s, output tok/s, prefix hit rate, ratios vs
round_robin), saves ``cluster_policies.png`` under benchmarks/results/, and ends with one JSON
line of headline figures. Target: prefix_affinity's mean TTFT <= 0.5 x round_robin's and
throughput >= 1.3 x.

Each worker's torch uses one thread (``OMP_NUM_THREADS=1``, inherited by the local Ray's
worker processes), so two workers share this machine's cores without oversubscription.

The code is :mod:`benchmarks.policy_bench` (workloads ``FULL`` and ``SMOKE`` included), also run
by ``kvcluster bench --compare-policies``, whose defaults are ``FULL``; this module keeps the
benchmark's name, flags and JSON keys.

    .venv/bin/python -m benchmarks.cluster_policies [--smoke] [--seeds 0,1,2]   # ~9 min full

Measured here (quiet 2-core VM, 100m model, ~756-token prompts, 4 groups, concurrency 8,
64 requests x seeds 0,1,2 per policy), three runs: prefix_affinity mean TTFT 0.307 x,
0.277 x and 0.338 x round_robin's (target <= 0.5: met; per seed 0.266 / 0.332 / 0.330,
0.262 / 0.278 / 0.296 and 0.256 / 0.304 / 0.488 - one seed alone can come close to the
line, which is why the pooled figure is the one judged), throughput 2.40 x, 2.54 x and
2.32 x (target >= 1.3 x), hit rate 0.90 vs 0.59-0.60; least_loaded 1.02 x, 0.77 x and
0.88 x round_robin's TTFT.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from benchmarks.policy_bench import FULL, POLICIES, SMOKE, compare, parse_seeds

__all__ = ["FULL", "SMOKE", "main"]


def main(argv: list[str] | None = None) -> dict[str, float | bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes (< 2 minutes)")
    p.add_argument("--requests", type=int, help="override the workload's request count")
    p.add_argument("--concurrency", type=int, help="override the workload's concurrency")
    p.add_argument("--seeds", help="comma-separated prompt seeds (default 0,1,2; smoke 0)")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated policies (round_robin must be one for the ratios)",
    )
    args = p.parse_args(argv)
    w = SMOKE if args.smoke else FULL
    w = replace(
        w,
        num_requests=args.requests or w.num_requests,
        concurrency=args.concurrency or w.concurrency,
        seeds=parse_seeds(args.seeds) if args.seeds else w.seeds,
    )
    return compare(w, args.policies.split(","))


if __name__ == "__main__":
    main()
