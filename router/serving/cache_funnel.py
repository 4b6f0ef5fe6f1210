"""The cache funnel of one router: where the prompt tokens it placed could have been served
from cache, stage by stage, and which tier the realised hits came from.

Each stage counts, over the requests that reached their first output, the prompt tokens

1. ``prompt``: of the prompts;
2. ``held``: the worker of the index holding the most of the prompt held (any tier);
3. ``best``: the best candidate would serve from cache (live, eligible, host hits weighed);
4. ``chosen``: the chosen worker was expected to serve (its cache, plus a priced pull);
5. ``realised``: the worker served from cache (the engine's prefix hit at admission).

A drop between stages names its cause: ``held``→``best``, the holder was not a candidate
(dead, full, another adapter); ``best``→``chosen``, the policy traded the hit for load;
``chosen``→``realised``, the index or a pull was wrong (what the router then heals, by a
resync of the worker's entries: :mod:`router.placement.prediction`).
"""

from __future__ import annotations

from kvstore.blocks.tiers import Tier
from kvstore.requests.outputs import Usage
from kvstore.requests.protocol import PullReport
from router.placement.placement_types import RouteDecision

STAGES = ("prompt", "held", "best", "chosen", "realised")


class CacheFunnel:
    """Running totals, by stage and by source tier (read at scrape time)."""

    def __init__(self) -> None:
        self.tokens = dict.fromkeys(STAGES, 0)  # stage -> prompt tokens
        self.requests = 0  # requests counted
        self.cached_by_tier = dict.fromkeys(Tier, 0)  # source tier -> realised cached tokens

    def observe(self, decision: RouteDecision, usage: Usage, pulled: PullReport | None) -> None:
        """A request's first output: its decision's figures and what the worker realised.
        Tokens a pull imported count as ``peer`` (they came from another worker's tiers)."""
        t = self.tokens
        realised = usage.cached_tokens
        t["prompt"] += usage.prompt_tokens
        t["held"] += decision.held_tokens
        t["best"] += decision.best_cached_tokens
        t["chosen"] += decision.cached_tokens_expected
        t["realised"] += realised
        self.requests += 1
        host = min(usage.host_cached_tokens, realised)
        peer = 0
        if pulled is not None and pulled.outcome == "ok":
            peer = min(pulled.tokens, realised - host)
        by_tier = self.cached_by_tier
        by_tier[Tier.HOST] += host
        by_tier[Tier.PEER] += peer
        by_tier[Tier.DEVICE] += realised - host - peer
