"""The built-in placement policies: round_robin, least_loaded, prefix_affinity.

prefix_affinity, and why it looks the way it does
--------------------------------------------------
Its cost is the time until this prompt's prefill would finish on a worker under FCFS, in
prefill-token units: the prompt tokens the worker would still compute plus the prefill
already queued there (plus an optional decode term). Taking the cheapest worker is greedy
shortest-expected-TTFT, so a cache hit wins exactly when it saves more than the extra queue
it waits behind — the trade NVIDIA Dynamo's KV router makes with its "overlap weight" on
new prefill blocks plus active blocks, and llm-d's weighted prefix/queue scorers.

Cost alone can still herd: with a very long shared prefix (tens of thousands of tokens, or
a whole conversation) the saving can exceed any queue, so every request of a hot prefix
piles onto its holder. SGLang's cache-aware router handles this with balance thresholds
(switch to shortest-queue once max load > rel x min and max - min > abs). We use the
consistent-hashing-with-bounded-loads idea instead, which degrades more gently: a worker
whose load exceeds ``mean + max(slack * mean, abs)`` is not eligible, and the cheapest of
the remaining workers wins — usually the next-best cache holder or the least loaded one,
which then caches the hot prefix too. The bound applies twice: to queued prefill tokens
(TTFT) and to requests in the worker (decode batch, KV memory), because on a lightly
loaded cluster queues are empty and only the request count shows a holder collecting every
session of a popular system prompt. So a hot prefix is replicated onto more workers
exactly when its holders are overloaded, and no worker's queue runs away from the mean.
A prefix shared by everyone (a system prompt cached on every worker) cancels out of the
comparison, leaving load: no herding.

The load bound does not see KV capacity: a few hot prefixes can each have a modest load and
still, together, overfill their holder's cache. With ``capacity_aware`` the router tracks each
prefix's home and every worker's committed blocks (``router/placement/prefix_homes.py``), and only
workers where this prefix fits are candidates (when any is): a full holder spills the prefix
to a worker with room, and first placements spread by capacity.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

from router.placement.placement_types import Placement, Reason, RouteRequest, WorkerView
from router.placement.routing_policy import ROUTING_POLICIES, RoutingPolicy, load_tokens

if TYPE_CHECKING:  # the config imports this module to validate policy names
    from router.placement.config import LeastLoadedConfig, PrefixAffinityConfig, RoutingConfig

_REL_TOL = 1e-9  # costs within this relative distance count as a tie


class _Sectioned(RoutingPolicy):
    """A policy with a section of the routing config of its own, named as the policy is
    (``routing.least_loaded``, ``routing.prefix_affinity``)."""

    def __init__(self, config: Any, rng: random.Random) -> None:
        self.config = config
        self._rng = rng

    @classmethod
    def from_config(cls, config: RoutingConfig, rng: random.Random) -> Self:
        return cls(getattr(config, cls.name), rng)


@ROUTING_POLICIES.register
class RoundRobin(RoutingPolicy):
    """Each request goes to the next worker in id order; ignores load and caches."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    @classmethod
    def from_config(cls, config: RoutingConfig, rng: random.Random) -> RoundRobin:
        return cls()

    def choose(self, request: RouteRequest, views: Sequence[WorkerView]) -> Placement:
        view = views[self._turn % len(views)]
        self._turn += 1
        return Placement(view.worker_id, Reason.ROUND_ROBIN, view.cached_tokens or 0)


@ROUTING_POLICIES.register
class LeastLoaded(_Sectioned):
    """Power of d choices: sample d workers, take the least loaded (first sampled on ties).

    Sampling instead of a global minimum keeps many routers with slightly stale loads from
    all picking the same "emptiest" worker at once.
    """

    name = "least_loaded"
    config: LeastLoadedConfig

    def choose(self, request: RouteRequest, views: Sequence[WorkerView]) -> Placement:
        d = min(self.config.choices, len(views))
        sample = self._rng.sample(range(len(views)), d)
        best = min(sample, key=lambda i: load_tokens(views[i].load, self.config))
        view = views[best]
        return Placement(view.worker_id, Reason.LOAD, view.cached_tokens or 0)


@ROUTING_POLICIES.register
class PrefixAffinity(_Sectioned):
    """Cheapest worker by (uncached prefill + queued prefill + decode load), load-bounded."""

    name = "prefix_affinity"
    config: PrefixAffinityConfig

    uses_prefix = True

    def choose(self, request: RouteRequest, views: Sequence[WorkerView]) -> Placement:
        cfg = self.config
        n_tokens = len(request.token_ids)
        cached = [min(v.cached_tokens or 0, n_tokens) for v in views]
        loads = [load_tokens(v.load, cfg) for v in views]
        costs = [
            cfg.prefill_weight * (n_tokens - c)
            + ld
            + (0.0 if v.adapter_loaded else cfg.adapter_load_tokens)
            for c, ld, v in zip(cached, loads, views, strict=True)
        ]
        eligible = _within_bound(loads, cfg.balance_slack, cfg.balance_abs_tokens)
        if cfg.balance_abs_requests is not None:
            reqs = [v.load.running + v.load.waiting for v in views]
            both = set(_within_bound(reqs, cfg.balance_slack, cfg.balance_abs_requests))
            eligible = [i for i in eligible if i in both] or eligible
        roomy = [i for i in eligible if views[i].kv_fits]  # see router/placement/prefix_homes.py
        pick = self._cheapest(roomy or eligible, costs, cached)
        if all(v.cached_tokens is None for v in views):
            reason = Reason.NO_INDEX
        elif costs[pick] > min(costs[i] for i in eligible) * (1 + _REL_TOL):
            reason = Reason.SPILL  # a cheaper eligible worker has no room for this prefix
        elif costs[pick] > min(costs) * (1 + _REL_TOL):
            reason = Reason.BALANCE  # a cheaper worker exists but is over the load bound
        elif cached[pick] > min(cached):
            reason = Reason.PREFIX
        else:
            reason = Reason.LOAD
        return Placement(views[pick].worker_id, reason, cached[pick])

    def _cheapest(self, candidates: list[int], costs: list[float], cached: list[int]) -> int:
        """Lowest cost; among equal costs the most cached (less total work), then random."""
        best = min(costs[i] for i in candidates)
        ties = [i for i in candidates if costs[i] <= best + abs(best) * _REL_TOL]
        most = max(cached[i] for i in ties)
        ties = [i for i in ties if cached[i] == most]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)


def _within_bound(loads: list[float] | list[int], slack: float, absolute: float) -> list[int]:
    """Indices whose load is at most mean + max(slack x mean, absolute) (never empty)."""
    mean = sum(loads) / len(loads)
    bound = mean + max(slack * mean, absolute)
    return [i for i, ld in enumerate(loads) if ld <= bound]
