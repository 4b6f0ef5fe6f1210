"""``kvcluster bench --compare-policies``: routing policies compared on one shared-prefix
workload, each on a fresh local cluster started in this process.

For each policy a fresh cluster (in-process Ray, local redis-server, 2-4 CPU workers, same
config except ``router.routing.policy``) serves the same seeded workload, cold (nothing
warmed): ``num_groups`` system prompts of ``prefix_words`` words, each request one of them
plus a distinct question, ``concurrency`` in flight. A fresh cluster per policy, not one
cluster re-configured, so no policy inherits the KV caches the previous one filled. Each
cluster serves every seed of ``Workload.seeds`` in turn (seeds share no system prompt, so
each starts cache-cold); figures pool the seeds, so a TTFT ratio is a ratio of seed means.

Prints progress, one table (TTFT mean/p50/p99, req/s, output tok/s, prefix hit rate, ratios
vs round_robin), saves ``cluster_policies.png`` under benchmarks/results/, and ends with one
JSON line of headline figures. ``benchmarks/cluster_policies.py`` is the same code with the
measured figures in its docstring.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.loadgen import Sample, make_prompts, send_all, summarize
from cluster.client import KVClusterClient
from cluster.config import ClusterConfig, ConfigError

POLICIES = ("round_robin", "least_loaded", "prefix_affinity")
BASELINE = "round_robin"  # the ratios' denominator


@dataclass(frozen=True)
class Workload:
    """One seeded shared-prefix workload and the cluster size it runs on."""

    model_size: str | None  # offline model (build_tiny size); None: the base config's model
    num_requests: int  # requests sent per policy
    concurrency: int  # requests in flight at once
    num_groups: int  # distinct system prompts
    prefix_words: int  # words per system prompt
    max_tokens: int  # tokens generated per request
    num_blocks: int  # KV blocks per worker (16 tokens each); embedded config only
    num_workers: int = 2  # CPU workers per cluster
    seeds: tuple[int, ...] = (0,)  # prompt RNG seeds, run in turn on each policy's cluster


# Prefill dominates as in real serving: the 100m model, long system prompts, short answers,
# and more distinct system prompts than one worker's KV cache holds (but not more than the
# cluster's), so where a request lands decides whether its prefix is recomputed.
FULL = Workload(
    model_size="100m",
    num_requests=64,
    concurrency=8,
    num_groups=4,
    prefix_words=300,
    max_tokens=8,
    num_blocks=128,
    seeds=(0, 1, 2),
)
SMOKE = Workload(
    model_size="tiny",
    num_requests=12,
    concurrency=4,
    num_groups=3,
    prefix_words=60,
    max_tokens=4,
    num_blocks=64,
)


@dataclass
class PolicyResult:
    """What one policy measured on one seed's prompts (or, pooled, on all of them)."""

    policy: str  # routing policy name
    samples: list[Sample]  # one per request, in completion order
    wall_s: float  # first send to last response (pooled: summed over the seeds' runs)
    seed: int | None = 0  # prompt seed (None: pooled over seeds)


def pooled(results: list[PolicyResult]) -> list[PolicyResult]:
    """One result per policy, in first-seen order: its seeds' samples together and their
    walls summed (the seeds run one after another). With equal request counts per seed the
    pooled mean TTFT is the mean of the seeds' means, so its ratio is a ratio of seed means."""
    out: dict[str, PolicyResult] = {}
    for r in results:
        p = out.setdefault(r.policy, PolicyResult(r.policy, [], 0.0, None))
        p.samples = p.samples + r.samples
        p.wall_s += r.wall_s
    return list(out.values())


def check_policies(policies: list[str]) -> None:
    """Raise :class:`ConfigError` naming the valid policies before any cluster starts (the
    routing config's own validation, run once per name)."""
    from pydantic import ValidationError

    from router.placement.config import RoutingConfig

    if not policies:
        raise ConfigError("no routing policies given")
    for policy in policies:
        try:
            RoutingConfig(policy=policy)
        except ValidationError as exc:
            raise ConfigError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``; :class:`ConfigError` naming the value otherwise."""
    try:
        seeds = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"seeds: {text!r} is not a comma-separated list of integers") from None
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: {text!r} repeats a seed")
    return seeds


def cluster_config(policy: str, w: Workload, base: ClusterConfig | None = None) -> ClusterConfig:
    """The cluster one policy runs on.

    Without ``base``: the embedded defaults sized by ``w`` (offline model of
    ``w.model_size``, ``w.num_workers`` workers with ``w.num_blocks`` KV blocks each). With
    ``base``: that config with ``policy``, and ``w.num_workers`` workers (and the offline
    ``w.model_size`` model when set). Either way a name of its own, free router ports and no
    dashboard, so it never collides with a cluster already running from the same YAML.
    """
    from worker.model.build_tiny import build_tiny_model

    if base is None:
        raw: dict = {
            "workers": {
                "num_cpus_per_worker": 0.5,
                "engine": {
                    "num_blocks": w.num_blocks,
                    "block_size": 16,
                    "max_waiting": 256,
                    "max_num_seqs": 16,
                    "max_num_batched_tokens": 1024,
                    "max_model_len": 2048,
                },
            }
        }
    else:
        raw = base.model_dump()
    if w.model_size is not None:
        raw["model"] = {
            **raw.get("model", {}),
            "path": str(build_tiny_model(family="llama", size=w.model_size)),
        }
    raw["name"] = f"bench-{policy}-{os.getpid()}"
    raw["dashboard"] = False
    raw["workers"]["num_workers"] = w.num_workers
    router = raw.setdefault("router", {})
    router["port"] = 0
    if router.get("http_port", 8000) is not None:  # any free port: never another cluster's
        router["http_port"] = 0
    router["routing"] = {**router.get("routing", {}), "policy": policy}
    return ClusterConfig.model_validate(raw)


def run_policy(
    policy: str,
    w: Workload,
    prompts: dict[int, list[str]],
    base: ClusterConfig | None = None,
    progress: TextIO | None = None,
) -> list[PolicyResult]:
    """Fresh cluster; each seed's prompts through it in turn at ``w.concurrency``; cluster
    stopped. Seeds share no system prompt, so each seed's run starts cache-cold too (the
    previous seed's blocks are only evictable leftovers, and its loads have drained)."""
    from cluster.launcher import Cluster  # late: imports Ray and the worker's model code

    out = []
    with (
        Cluster(cluster_config(policy, w, base)) as cluster,
        KVClusterClient(cluster.endpoints[0]) as client,
    ):
        for seed, seed_prompts in prompts.items():
            samples, wall = send_all(
                client,
                seed_prompts,
                concurrency=w.concurrency,
                max_tokens=w.max_tokens,
                progress=progress,
            )
            out.append(PolicyResult(policy, samples, wall, seed))
    return out


_FIGURES = (
    "ok",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "req_s",
    "out_tok_s",
    "hit_rate",
    "prompt_tokens_mean",
)


def figures(r: PolicyResult) -> dict[str, float]:
    """One policy's figures over its successful requests (the table's columns, in order)."""
    f = summarize(r.samples, r.wall_s)
    return {k: f[k] for k in _FIGURES}


def table_rows(results: list[PolicyResult]) -> list[dict]:
    """One row per policy (its seeds pooled), with mean-TTFT and throughput ratios vs
    round_robin when it ran."""
    figs = {r.policy: figures(r) for r in pooled(results)}
    rr = figs.get(BASELINE)
    rows = []
    for name, f in figs.items():
        row = {"policy": name, **{k: v for k, v in f.items() if k != "prompt_tokens_mean"}}
        if rr:
            row["ttft_vs_rr"] = f["ttft_mean_s"] / rr["ttft_mean_s"]
            row["thru_vs_rr"] = f["req_s"] / rr["req_s"]
        rows.append(row)
    return rows


def headline(results: list[PolicyResult]) -> dict[str, float | bool | list[float]]:
    """The JSON line: per policy mean TTFT, req/s and hit rate (seeds pooled);
    prefix_affinity's ratios vs round_robin and whether the targets (TTFT <= 0.5x,
    throughput >= 1.3x) are met, judged on the pooled figures (the ratio of seed means), and
    with several seeds the per-seed TTFT ratios too. The pooled keys are a single-seed run's
    keys, so runs of one seed and of several compare."""
    figs = {r.policy: figures(r) for r in pooled(results)}
    out: dict[str, float | bool | list[float]] = {}
    for name, f in figs.items():
        out[f"{name}_ttft_mean_s"] = round(f["ttft_mean_s"], 4)
        out[f"{name}_req_s"] = round(f["req_s"], 4)
        out[f"{name}_hit_rate"] = round(f["hit_rate"], 4)
    rr, pa = figs.get(BASELINE), figs.get("prefix_affinity")
    if rr and pa:
        out["ttft_ratio_vs_rr"] = round(pa["ttft_mean_s"] / rr["ttft_mean_s"], 4)
        out["throughput_ratio_vs_rr"] = round(pa["req_s"] / rr["req_s"], 4)
        out["targets_met"] = bool(
            out["ttft_ratio_vs_rr"] <= 0.5 and out["throughput_ratio_vs_rr"] >= 1.3
        )
        seeds = sorted({r.seed for r in results if r.seed is not None})
        if len(seeds) > 1:
            out["seeds"] = seeds
            out["ttft_ratio_per_seed"] = [
                round(
                    _seed_mean(results, "prefix_affinity", s) / _seed_mean(results, BASELINE, s), 4
                )
                for s in seeds
            ]
    return out


def _seed_mean(results: list[PolicyResult], policy: str, seed: int) -> float:
    r = next(r for r in results if r.policy == policy and r.seed == seed)
    return figures(r)["ttft_mean_s"]


def plot(results: list[PolicyResult]) -> Path:
    """TTFT CDF per policy and mean TTFT bars labelled with hit rate and req/s (seeds
    pooled)."""
    results = pooled(results)
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ttft = sorted(s.ttft_s * 1e3 for s in r.samples if s.ok)
        ax[0].plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=r.policy)
    ax[0].set_xlabel("TTFT (ms)")
    ax[0].set_ylabel("fraction of requests")
    ax[0].legend()
    figs = [figures(r) for r in results]
    ax[1].bar([r.policy for r in results], [f["ttft_mean_s"] * 1e3 for f in figs])
    ax[1].set_ylabel("mean TTFT (ms)")
    for i, f in enumerate(figs):
        ax[1].text(
            i,
            f["ttft_mean_s"] * 1e3,
            f"hit {f['hit_rate']:.0%}\n{f['req_s']:.2f} req/s",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    return save_figure(fig, "cluster_policies.png")


def model_label(w: Workload, base: ClusterConfig | None) -> str:
    if w.model_size is not None:
        return w.model_size
    if base is not None and base.model.path:
        return Path(base.model.path).name
    if base is None or base.model.tiny_family is not None:
        return "tiny"
    return "SmolLM2-135M-Instruct"  # the default model


def compare(
    w: Workload,
    policies: list[str] | tuple[str, ...] = POLICIES,
    base: ClusterConfig | None = None,
    out: TextIO | None = None,
    progress: TextIO | None = None,
) -> dict[str, float | bool | list[float]]:
    """Run every policy in turn on ``w`` (each on its own cluster, ``w.seeds`` in turn on it);
    print progress, the table, the plot's path and the
    JSON line on ``out`` (progress bars on ``progress``, default stderr); return the headline.

    Sets ``OMP_NUM_THREADS=1`` (unless set) before the first cluster starts: the local Ray's
    worker processes inherit it, so the workers share the machine's cores without each
    spawning a thread per core.
    """
    out = out or sys.stdout
    check_policies(list(policies))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    print(f"workload: {w}", file=out, flush=True)
    prompts = {
        seed: make_prompts(w.num_requests, w.num_groups, w.prefix_words, seed) for seed in w.seeds
    }
    results: list[PolicyResult] = []
    for policy in policies:
        print(
            f"{policy}: starting a cluster of {w.num_workers} workers "
            f"({model_label(w, base)} model)",
            file=out,
            flush=True,
        )
        runs = run_policy(policy, w, prompts, base, progress=progress or sys.stderr)
        results.extend(runs)
        for r in (runs if len(runs) > 1 else []) + pooled(runs):
            f = figures(r)
            errors = sorted({s.code for s in r.samples if not s.ok})
            label = f"  seed {r.seed}" if r.seed is not None and len(runs) > 1 else policy
            print(
                f"{label}: {f['ok']}/{len(r.samples)} ok in {r.wall_s:.1f}s, "
                f"mean TTFT {f['ttft_mean_s'] * 1e3:.0f} ms, hit {f['hit_rate']:.0%}"
                + (f", errors {errors}" if errors else ""),
                file=out,
                flush=True,
            )
    tokens = figures(pooled(results)[0])["prompt_tokens_mean"]
    print_table(
        table_rows(results),
        f"routing policies, {w.num_workers} workers, "
        f"{model_label(w, base)} model, ~{tokens:.0f} prompt tokens",
        out=out,
    )
    print(f"plot: {plot(results)}", file=out)
    head = headline(results)
    emit_json(head, out=out)
    return head
