"""Peer pulls in the simulator: a hot prefix whose holder is saturated is pulled (from the
holder's real KV manager into the destination's) instead of recomputed; fewer tokens are
computed, more are hit, nothing is left in use."""

from __future__ import annotations

import pytest

from router import RoutingConfig
from router.sim import SimConfig, SimRequest, replay, summarize
from tests.router.harness import tokens


def burst(n: int = 24, prefix_len: int = 8192) -> list[SimRequest]:
    """``n`` requests with one long shared prefix and their own tails, arriving in 0.1 s."""
    prefix = tokens(1, prefix_len)
    return [SimRequest(f"r{i}", 0.5 + i * 0.004, prefix + tokens(100 + i, 64), 4) for i in range(n)]


def run(pull: bool, policy: str = "prefix_affinity"):
    sim = SimConfig(num_workers=4, kv_tokens_per_worker=200_000, block_size=16)
    tm = sim.time
    routing = RoutingConfig(
        policy=policy,
        pull={
            "enabled": pull,
            "prefill_tokens_per_s": 1 / tm.prefill_s_per_token,
            "fixed_s": tm.pull_fixed_s,
            "per_token_s": tm.pull_s_per_token,
        },
    )
    warm = [SimRequest("warm", 0.0, tokens(1, 8192) + tokens(99, 8), 1)]
    return replay(warm + burst(), routing, sim)


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_loaded"])
def test_pulls_replace_recomputing_a_hot_prefix(policy: str) -> None:
    off, on = run(False, policy), run(True, policy)
    s_off, s_on = summarize(off), summarize(on)
    assert on.extra["pulls"].get("ok", 0) >= 1 and on.extra["pulled_tokens"] > 0
    assert sum(on.computed_prefill.values()) < sum(off.computed_prefill.values())
    assert s_on.hit_rate > s_off.hit_rate and s_on.requests == s_off.requests == 25
    assert s_on.ttft_mean_s < s_off.ttft_mean_s
    assert off.extra["pulls"] == {} and off.extra["pulled_tokens"] == 0
    assert s_on.parity_mismatches == 0 and on.index_gaps == 0
