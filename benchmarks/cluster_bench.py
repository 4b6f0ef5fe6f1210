"""``kvcluster bench``: load-test a running cluster, or compare routing policies on fresh ones.

The ``kvcluster`` CLI runs this module for its ``bench`` sub-command (``python -m
benchmarks.cluster_bench ARGS``), so the product package never imports the benchmarks.

    kvcluster bench [--target HOST:PORT | --name NAME] [--api grpc|http] [--requests N] ...
    kvcluster bench --compare-policies [--model-size tiny|32m|100m] [--config FILE.yaml] ...

Without ``--compare-policies``: :func:`benchmarks.loadgen.run_bench` against the cluster at
``--target`` (default: the one ``kvcluster up --name NAME`` started); sizes default to 64
requests, 8 in flight, 4 system prompts, 16 tokens. With it: a fresh in-process cluster per
policy (:func:`benchmarks.policy_bench.compare`), sizes defaulting to the benchmark's ``FULL``
workload (64/8/4/8 tokens on the 100m model).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from cluster.cli import exit_code
from cluster.config import ConfigError, load_config

_COMPARE_ONLY = ("workers", "model_size", "config", "policies", "seeds")


def endpoint(args: argparse.Namespace) -> str:
    if args.target:
        return args.target
    from cluster.launcher import ClusterState

    return ClusterState.load(args.name).endpoint(args.api)


def load_test(args: argparse.Namespace) -> int:
    given = [f"--{k.replace('_', '-')}" for k in _COMPARE_ONLY if getattr(args, k) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: only with --compare-policies")
    from benchmarks.loadgen import run_bench

    sizes = {
        "num_requests": args.requests,
        "concurrency": args.concurrency,
        "num_groups": args.groups,
        "max_tokens": args.max_tokens,
    }
    run_bench(endpoint(args), api=args.api, **{k: v for k, v in sizes.items() if v is not None})
    return 0


def compare_policies(args: argparse.Namespace) -> int:
    """A fresh in-process cluster per policy; defaults are the benchmark's FULL workload."""
    from benchmarks.policy_bench import FULL, POLICIES, compare, parse_seeds

    if args.target:
        raise ConfigError("--compare-policies starts its own clusters; drop --target")
    base = load_config(args.config) if args.config else None
    default_size = None if base else FULL.model_size  # a --config brings its own model
    w = replace(
        FULL,
        model_size=args.model_size or default_size,
        num_workers=args.workers or (base.workers.num_workers if base else 2),
        num_requests=args.requests or FULL.num_requests,
        concurrency=args.concurrency or FULL.concurrency,
        num_groups=args.groups or FULL.num_groups,
        max_tokens=args.max_tokens or FULL.max_tokens,
        seeds=parse_seeds(args.seeds) if args.seeds else FULL.seeds,
    )
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    compare(w, policies, base)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcluster bench", description="load generator: table, plot, JSON line"
    )
    p.add_argument("--name", default="kvcluster", help="cluster name (state file)")
    p.add_argument(
        "--target",
        help="router host:port, several comma-separated (calls take turns and fail over), "
        "or an HTTP URL; default: every router of the state file",
    )
    p.add_argument("--requests", type=int, help="requests (per policy with --compare-policies)")
    p.add_argument("--concurrency", type=int, help="requests in flight")
    p.add_argument("--groups", type=int, help="distinct shared system prompts")
    p.add_argument("--max-tokens", type=int, help="tokens generated per request")
    p.add_argument(
        "--api",
        choices=("grpc", "http"),
        default="grpc",
        help="drive the gRPC API or the OpenAI HTTP API (--target: its URL)",
    )
    cmp = p.add_argument_group(
        "--compare-policies",
        "a fresh local cluster per routing policy, same seeded workload: "
        "TTFT, throughput and hit rate with ratios vs round_robin, PNG, JSON line",
    )
    cmp.add_argument(
        "--compare-policies",
        action="store_true",
        help="start a cluster per policy in this process instead of using --target",
    )
    cmp.add_argument(
        "--workers",
        type=int,
        choices=(2, 3, 4),
        help="CPU workers per cluster (default 2, or the --config's count)",
    )
    cmp.add_argument(
        "--model-size",
        choices=("tiny", "32m", "100m"),
        help="offline model (default 100m; with --config, the config's model)",
    )
    cmp.add_argument(
        "--config",
        help="base cluster YAML; per run its policy, name and router port are overridden "
        "and the dashboard is off (default: embedded defaults)",
    )
    cmp.add_argument(
        "--policies", help="comma-separated (default round_robin,least_loaded,prefix_affinity)"
    )
    cmp.add_argument(
        "--seeds",
        help="comma-separated prompt seeds, run in turn on each policy's cluster; figures and "
        "targets are over all of them (default 0,1,2)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = compare_policies if args.compare_policies else load_test
    return exit_code("kvcluster bench", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
