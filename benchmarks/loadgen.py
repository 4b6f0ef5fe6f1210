"""The load generator behind ``kvcluster bench``: gRPC or OpenAI HTTP against a running cluster.

Sends groups of prompts that share a long prefix (a system prompt per group plus a
distinct question), ``concurrency`` at a time, and reports latency, TTFT, throughput and
where the requests were routed, with cached prompt tokens. A table on stdout, a PNG under
``benchmarks/results/`` and one JSON line of headline figures at the end.

The pieces (prompts, one timed streaming request, percentiles, sending a list of prompts at a
fixed concurrency) are shared with ``kvcluster bench --compare-policies``
(:mod:`benchmarks.policy_bench`), which runs one fresh cluster per routing policy.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc

from benchmarks.common import pyplot, save_figure
from benchmarks.progress import Progress
from cluster.client import Completion, KVClusterClient, accumulate, build_request
from kvstore.runtime.stats import quantile


@dataclass
class Sample:
    """What one streamed request measured, from the client's side."""

    ok: bool  # finished without a gRPC error
    code: str  # gRPC status name ("OK", "UNAVAILABLE", ...)
    latency_s: float  # send to last response
    ttft_s: float  # send to first token (nan when none came)
    worker: str  # worker that served it ("" on error)
    prompt_tokens: int  # prompt length in tokens
    cached_tokens: int  # prompt tokens served from the worker's prefix cache
    completion_tokens: int  # tokens generated


WORDS = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kernel",
    "cache",
    "block",
    "route",
    "token",
    "prefix",
    "worker",
    "stream",
    "batch",
    "queue",
    "model",
    "index",
    "epoch",
    "ray",
)


def make_prompts(
    num_requests: int, num_groups: int, prefix_words: int, seed: int, *, zipf: float = 0.0
) -> list[str]:
    """Seeded shared-prefix prompts: ``num_groups`` system prompts of ``prefix_words`` words
    (:func:`make_prefixes`), each request one of them plus a distinct question. The system
    prompt is drawn uniformly, or with ``zipf`` > 0 the ``r``-th (from 0) with weight
    ``1 / (r + 1) ** zipf`` (a few hot prefixes and a long tail, as production traffic is)."""
    rng = random.Random(seed)
    prefixes = _prefixes(rng, num_groups, prefix_words)
    weights = [1.0 / (r + 1) ** zipf for r in range(num_groups)]
    out = []
    for i in range(num_requests):
        g = rng.randrange(num_groups) if zipf == 0 else rng.choices(range(num_groups), weights)[0]
        question = " ".join(rng.choice(WORDS) for _ in range(8))
        out.append(f"System: {prefixes[g]}\nUser: question {i} {question}")
    return out


def make_prefixes(num_groups: int, prefix_words: int, seed: int) -> list[str]:
    """The system prompts :func:`make_prompts` draws from with the same arguments."""
    return _prefixes(random.Random(seed), num_groups, prefix_words)


def _prefixes(rng: random.Random, num_groups: int, prefix_words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(num_groups)]


def one_request(client: KVClusterClient, prompt: str, max_tokens: int) -> Sample:
    """Stream one greedy completion; a gRPC error becomes a failed sample, never raises."""
    t0 = time.perf_counter()
    ttft = float("nan")
    out = Completion()
    try:
        for msg in client.stream(
            build_request(prompt, max_tokens=max_tokens, temperature=0.0), timeout=300
        ):
            if msg.token_ids and ttft != ttft:
                ttft = time.perf_counter() - t0
            accumulate(out, msg)
        code = "OK"
    except grpc.RpcError as exc:
        code = exc.code().name
    return Sample(
        code == "OK",
        code,
        time.perf_counter() - t0,
        ttft,
        out.worker_id,
        out.prompt_tokens,
        out.cached_tokens,
        out.completion_tokens,
    )


def send_all(
    client: Any,
    prompts: list[str],
    *,
    concurrency: int,
    max_tokens: int,
    progress: TextIO | None = None,
    one: Callable[[Any, str, int], Sample] = one_request,
) -> tuple[list[Sample], float]:
    """Send ``prompts`` ``concurrency`` at a time; returns the samples (in completion order)
    and the wall time from first send to last response. ``one(client, prompt, max_tokens)``
    times one request (gRPC by default). With ``progress``, reports there (a separate stream,
    so the table and JSON line on stdout stay parseable): a bar redrawn on a terminal, a line
    per few seconds elsewhere (:mod:`benchmarks.progress`)."""
    samples: list[Sample] = []
    lock = threading.Lock()
    bar = Progress(progress, len(prompts), "requests") if progress is not None else None

    def task(prompt: str) -> None:
        s = one(client, prompt, max_tokens)
        with lock:
            samples.append(s)
            if bar is not None:
                bar.update(len(samples))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(task, prompts))
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return samples, wall


def summarize(samples: list[Sample], wall_s: float) -> dict[str, float]:
    """Figures over the successful samples of a run that took ``wall_s``: ok (count), req_s,
    out_tok_s, ttft_mean_s / p50 / p99, latency_p50_s / p99, hit_rate (cached / prompt
    tokens), prompt_tokens_mean."""
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft_s for s in ok]
    latency = [s.latency_s for s in ok]
    prompt_tok = sum(s.prompt_tokens for s in ok)
    return {
        "ok": len(ok),
        "req_s": len(ok) / wall_s,
        "out_tok_s": sum(s.completion_tokens for s in ok) / wall_s,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "latency_p50_s": quantile(latency, 0.5),
        "latency_p99_s": quantile(latency, 0.99),
        "hit_rate": sum(s.cached_tokens for s in ok) / prompt_tok if prompt_tok else 0.0,
        "prompt_tokens_mean": prompt_tok / len(ok) if ok else 0.0,
    }


def run_bench(
    target: str,
    *,
    num_requests: int = 64,
    concurrency: int = 8,
    num_groups: int = 4,
    prefix_words: int = 200,
    max_tokens: int = 16,
    seed: int = 0,
    plot: bool = True,
    out: TextIO | None = None,
    api: str = "grpc",
) -> dict[str, float]:
    """Load-test the running cluster at ``target``: table, PNG and JSON line on ``out``.
    ``api``: "grpc" (``target`` host:port, or several comma-separated: requests take turns
    over them and fail over) or "http" (``target`` the OpenAI API's URL)."""
    out = out or sys.stdout
    prompts = make_prompts(num_requests, num_groups, prefix_words, seed)
    one: Callable[[Any, str, int], Sample] = one_request
    if api == "http":
        from benchmarks.loadgen_http import OpenAIBenchClient, one_http_request

        client_cm: Any = OpenAIBenchClient(target)
        one = one_http_request
    else:
        client_cm = KVClusterClient(target)
    with client_cm as client:
        samples, wall = send_all(
            client,
            prompts,
            concurrency=concurrency,
            max_tokens=max_tokens,
            progress=sys.stderr,
            one=one,
        )
    ok = [s for s in samples if s.ok]
    f = summarize(samples, wall)
    figures = {
        "requests": float(num_requests),
        "ok": float(f["ok"]),
        "throughput_req_s": f["req_s"],
        "output_tok_s": f["out_tok_s"],
        "latency_p50_s": f["latency_p50_s"],
        "latency_p99_s": f["latency_p99_s"],
        "ttft_p50_s": f["ttft_p50_s"],
        "ttft_p99_s": f["ttft_p99_s"],
        "prefix_hit_rate": f["hit_rate"],
    }
    print(f"{'metric':<20}{'value':>14}", file=out)
    for k, v in figures.items():
        print(f"{k:<20}{v:>14.4f}", file=out)
    per_worker = Counter(s.worker for s in ok)
    print(f"\n{'worker':<28}{'requests':>10}", file=out)
    for w, n in sorted(per_worker.items()):
        print(f"{w:<28}{n:>10}", file=out)
    errors = Counter(s.code for s in samples if not s.ok)
    if errors:
        print(f"errors: {dict(errors)}", file=out)
    if plot and ok:
        _plot(ok)
    print(json.dumps({"bench": figures, "api": api}), file=out)
    return figures


def _plot(samples: list[Sample]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].hist([s.ttft_s * 1e3 for s in samples], bins=30)
    ax[0].set_xlabel("TTFT (ms)")
    ax[0].set_ylabel("requests")
    ax[1].scatter([s.cached_tokens for s in samples], [s.ttft_s * 1e3 for s in samples], s=8)
    ax[1].set_xlabel("cached prompt tokens")
    ax[1].set_ylabel("TTFT (ms)")
    return save_figure(fig, "cluster_bench.png")
