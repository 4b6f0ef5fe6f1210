"""Headline figures of a replay, and its hit rate split by the tier each hit came from."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kvstore.blocks.tiers import HELD_TIERS, Tier
from kvstore.runtime.stats import quantile
from router.sim.records import RequestRecord
from router.sim.replay import ReplayResult


@dataclass(frozen=True)
class Summary:
    """Per-policy headline figures."""

    policy: str  # routing policy
    num_workers: int  # simulated workers
    requests: int  # requests served (rejected excluded)
    hit_rate: float  # prompt tokens served from cache / prompt tokens
    imbalance: float  # max / mean of prompt tokens computed per worker
    ttft_mean_s: float  # time to first token
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    throughput_req_s: float  # requests finished / (last finish - first arrival)
    throughput_tok_s: float  # prompt + output tokens / the same span
    utilization: float  # mean fraction of the span the workers spent in steps
    predicted_hit_error: float  # sum |expected - actual cached tokens| / prompt tokens
    no_index_decisions: int  # decisions routed by load for lack of prefix data
    pending_assists: int  # decisions where the router's pending placements knew more
    parity_mismatches: int  # router keys != worker keys (must be 0)
    decision_p50_ms: float  # router decision latency (hashing + lookup + policy)
    decision_p99_ms: float
    rejected: int  # requests that could never fit a worker's KV cache
    wall_s: float  # real seconds of the replay

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def summarize(result: ReplayResult) -> Summary:
    served = [r for r in result.records if not r.rejected]
    ttfts = sorted(r.first_token_s - r.arrival_s for r in served)
    prompt = sum(r.input_len for r in served)
    cached = sum(r.cached_tokens for r in served)
    computed = list(result.computed_prefill.values())
    mean_computed = sum(computed) / len(computed)
    start = min((r.arrival_s for r in served), default=0.0)
    span = max((r.finish_s for r in served), default=start) - start
    span = span if span > 0 else math.nan
    metrics = result.router_metrics
    no_index = sum(n for k, n in metrics["decisions"].items() if k.endswith("/no-index"))
    return Summary(
        policy=result.policy,
        num_workers=result.num_workers,
        requests=len(served),
        hit_rate=cached / prompt if prompt else 0.0,
        imbalance=max(computed) / mean_computed if mean_computed else 1.0,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        ttft_p50_s=quantile(ttfts, 0.50),
        ttft_p90_s=quantile(ttfts, 0.90),
        ttft_p99_s=quantile(ttfts, 0.99),
        throughput_req_s=len(served) / span,
        throughput_tok_s=sum(r.input_len + r.output_len for r in served) / span,
        utilization=sum(result.busy_s.values()) / (len(result.busy_s) * span),
        predicted_hit_error=(
            sum(abs(r.expected_cached - r.cached_tokens) for r in served) / prompt
            if prompt
            else 0.0
        ),
        no_index_decisions=no_index,
        pending_assists=metrics["pending_assists"],
        parity_mismatches=metrics["parity_mismatches"],
        decision_p50_ms=metrics["decision_latency_p50_s"] * 1e3,
        decision_p99_ms=metrics["decision_latency_p99_s"] * 1e3,
        rejected=len(result.records) - len(served),
        wall_s=result.wall_s,
    )


def tier_hit_rates(records: Iterable[RequestRecord]) -> dict[Tier, float]:
    """Per held tier, the prompt tokens served from it over the prompt tokens of the served
    (not rejected) requests; they add up to the hit rate. Device: hits no lower tier held."""
    prompt = 0
    hits = dict.fromkeys(HELD_TIERS, 0)
    for r in records:
        if r.rejected:
            continue
        prompt += r.input_len
        lower = sum(r.tier_cached_tokens.values())
        hits[Tier.DEVICE] += r.cached_tokens - lower
        for tier, n in r.tier_cached_tokens.items():
            hits[tier] += n
    return {t: n / prompt if prompt else 0.0 for t, n in hits.items()}
