"""The router's placement core: hash the prompt, ask the prefix source, merge in its own
pending placements, let the policy choose, and record metrics. No Ray, no gRPC here: the
actor/servicer wraps this class."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from kvstore.blocks.hashing import BlockKey, block_keys
from kvstore.blocks.protocol import PullReport
from kvstore.types import WorkerLoad
from router.placement.breaker import CircuitOpen
from router.placement.cached import cached_tokens, held_blocks
from router.placement.config import RoutingConfig
from router.placement.parity import check_parity
from router.placement.pending import PendingPlacements
from router.placement.placement_types import (
    NoWorkersError,
    RouteDecision,
    RouteRequest,
    WorkerId,
    WorkerView,
)
from router.placement.prefix_homes import PrefixHomes
from router.placement.prefix_source import PrefixSource, TierCounts, device_only
from router.placement.pull import PullPlanner, TransferModel
from router.placement.pull_ledger import PullLedger
from router.placement.router_metrics import RouterMetrics
from router.placement.routing_policy import make_policy

log = logging.getLogger(__name__)


class Prepared(NamedTuple):
    """A request's placement inputs read ahead (:meth:`Router.prepare`)."""

    start: float  # perf_counter when its routing began
    keys: tuple[BlockKey, ...]  # its prompt's block keys (empty: the policy reads none)
    index: Mapping[WorkerId, TierCounts] | None  # the index's answer (None: none)


class Router:
    """Places requests on workers. Not thread-safe: one per event loop / actor.

    ``prefix_source`` may be ``None`` (no index configured); ``block_size`` is the workers'
    KV block size (the router hashes prompts into the same blocks); ``clock`` gives seconds
    for the pending-placement TTL (the simulator passes its simulated clock).
    """

    def __init__(
        self,
        config: RoutingConfig,
        prefix_source: PrefixSource | None = None,
        *,
        block_size: int,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.config = config
        self.block_size = block_size
        self.policy = make_policy(config, rng)
        self.prefix_source = prefix_source
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.pending = PendingPlacements(config.pending_ttl_s, config.pending_settle_s)
        pa = config.prefix_affinity
        self.homes: PrefixHomes | None = None  # prefix_affinity's KV capacity check
        if config.policy == "prefix_affinity" and pa.capacity_aware:
            # a first touch's whole prompt stays committed as long as the router remembers
            # the placement itself (its pending prefix), then the index shows what it shares
            self.homes = PrefixHomes(pa.home_ttl_s, config.pending_ttl_s or None)
        self._clock = clock
        self.planner: PullPlanner | None = None  # peer pulls priced per request
        self.nodes: dict[WorkerId, str] = {}  # worker -> node id, learned from pull reports
        pc = config.pull
        if pc.enabled:
            transfers = TransferModel(
                pc.fixed_s, pc.per_token_s, cross_node_factor=pc.cross_node_factor, alpha=pc.alpha
            )
            self.planner = PullPlanner(
                transfers,
                prefill_tokens_per_s=pc.prefill_tokens_per_s,
                min_pull_tokens=pc.min_pull_tokens,
                min_deadline_s=pc.min_deadline_s,
                block_size=block_size,
                source_step_tokens=pc.source_step_tokens,
                max_pulls_per_source=pc.max_pulls_per_source,
                hold_max_extra_requests=pc.hold_max_extra_requests,
                ledger=PullLedger(alpha=pc.alpha, recovery_s=pc.survival_recovery_s),
                node_of=lambda w: self.nodes.get(w, ""),
            )

    def route(
        self,
        request: RouteRequest,
        candidates: Mapping[WorkerId, WorkerLoad],
        prepared: Prepared | None = None,
    ) -> RouteDecision:
        """Choose a worker among ``candidates`` (live workers and their last load);
        ``prepared``: its keys and index answer read already (:meth:`prepare`).

        Never fails for the index's sake: if the prefix source raises, routes by load.
        Raises :class:`NoWorkersError` when ``candidates`` is empty.
        """
        if prepared is None:
            start, keys = self._begin(request, candidates)
            index = self._lookup(keys, candidates) if keys else None
        else:
            start, keys, index = prepared
        return self._decide(request, candidates, keys, index, start)

    def prepare(
        self, batch: Sequence[tuple[RouteRequest, Mapping[WorkerId, WorkerLoad]]]
    ) -> list[Prepared | Exception]:
        """Hash the prompts of requests placed together and read the index for all of them
        in one round trip; :meth:`route` then decides each, in order, with its own answer
        (the index as it was at this read, as one lookup of its own would have seen it).
        A request that cannot be routed gets its exception in its place."""
        begun: list[tuple[float, tuple[BlockKey, ...]] | Exception] = []
        for request, candidates in batch:
            try:
                begun.append(self._begin(request, candidates))
            except Exception as exc:  # noqa: BLE001 - that request's error, not the batch's
                begun.append(exc)
        asks = [
            (i, b[1], self._wants_tiers(batch[i][1]))
            for i, b in enumerate(begun)
            if not isinstance(b, Exception) and b[1]
        ]
        answers: dict[int, Mapping[WorkerId, TierCounts] | None] = {}
        source = self.prefix_source
        if asks and source is not None:
            try:
                got = source.lookup_many([(keys, tiers) for _, keys, tiers in asks])
                answers = {i: a for (i, _, _), a in zip(asks, got, strict=True)}
            except Exception as exc:  # noqa: BLE001 - degrade, never fail: route by load
                for _ in asks:  # each request's read failed
                    self._index_error(exc)
        return [
            b if isinstance(b, Exception) else Prepared(b[0], b[1], answers.get(i))
            for i, b in enumerate(begun)
        ]

    def _begin(
        self, request: RouteRequest, candidates: Mapping[WorkerId, WorkerLoad]
    ) -> tuple[float, tuple[BlockKey, ...]]:
        """Start the clock, validate, and hash the prompt if the policy reads prefixes."""
        start = time.perf_counter()
        if not candidates:
            raise NoWorkersError(
                f"no live worker to route request {request.request_id!r} to; start workers or "
                "check that their heartbeats reach Redis"
            )
        if not self.policy.uses_prefix and self.planner is None:
            return start, ()
        keys = request.keys
        if keys is None:
            ctx = request.hash_ctx
            if not self.config.adapter_aware:  # the baseline: hash as if there were no adapter
                ctx = replace(ctx, lora_id=None)
            keys = tuple(block_keys(request.token_ids, self.block_size, ctx))
        return start, keys

    def _decide(
        self,
        request: RouteRequest,
        candidates: Mapping[WorkerId, WorkerLoad],
        keys: tuple[BlockKey, ...],
        index: Mapping[WorkerId, TierCounts] | None,
        start: float,
    ) -> RouteDecision:
        ids = sorted(candidates)
        if self.policy.uses_prefix or keys:
            cached = self._cached_tokens(keys, len(request.token_ids), ids, index)
        else:
            cached = dict.fromkeys(ids)
        lora_id = request.hash_ctx.lora_id if self.config.adapter_aware else None
        prefix, shared, now = (), 0, self._clock()
        if self.homes is not None and keys:
            shared = max((c or 0 for c in cached.values()), default=0) // self.block_size
            cap = (len(request.token_ids) - 1) // self.block_size
            prefix = self.homes.prefix_of(keys, shared, cap)
        views = [
            WorkerView(
                w,
                candidates[w],
                cached[w],
                lora_id is None or lora_id in candidates[w].lora_loaded,
                self.homes is None or self.homes.fits(prefix, w, candidates[w].total_blocks, now),
            )
            for w in ids
        ]
        placement = self.policy.choose(request, views)
        pull = pull_ticket = None
        if self.planner is not None and keys and index is not None:
            pending = self.pending.lookup(keys, self._clock())
            held = held_blocks(ids, len(request.token_ids), self.block_size, index, pending)
            placement, pull, _ = self.planner.plan(
                len(request.token_ids),
                views,
                placement,
                held,
                holder_eligible=self.policy.uses_prefix,
                now=now,
            )
            if pull is not None:
                pull_ticket = self.planner.ledger.begin(
                    pull.source_id, placement.worker_id, pull.num_blocks
                )
        if self.homes is not None:
            self.homes.place(prefix, placement.worker_id, now, first=shared == 0)
        ticket = self.pending.record(placement.worker_id, keys, now) if keys else None
        decision = RouteDecision(
            worker_id=placement.worker_id,
            policy=self.policy.name,
            reason=placement.reason,
            cached_tokens_expected=placement.cached_tokens_expected,
            decision_latency_s=time.perf_counter() - start,
            keys=keys,
            pull=pull,
            pending=ticket,
            pull_ticket=pull_ticket,
        )
        self.metrics.observe(decision)
        return decision

    def settle(self, decision: RouteDecision) -> None:
        """``decision``'s request has its first token (its blocks are stored, the index
        learns of them within a step), or ended without one: its pending prefix is
        remembered only ``pending_settle_s`` longer (see :mod:`router.placement.pending`)."""
        self.pending.settle(decision.pending, self._clock())
        if self.planner is not None and decision.pull_ticket is not None:
            self.planner.ledger.end(decision.pull_ticket)

    def pull_reported(self, decision: RouteDecision, report: PullReport) -> None:
        """The worker reported ``decision``'s pull: its source is free; a pull that brought
        nothing counts as a miss of its destination's (nothing of it survived)."""
        if self.planner is None or decision.pull_ticket is None:
            return
        self.planner.ledger.landed(decision.pull_ticket)
        if report.outcome != "ok" or not report.tokens:
            self.planner.ledger.observe(decision.worker_id, 0.0, self._clock())

    def pull_used(self, decision: RouteDecision, report: PullReport, realised: int) -> None:
        """``decision``'s request, whose pull imported ``report.tokens``, ran with a prefix
        hit of ``realised`` tokens: the share of the import still cached then is what
        pulling to that worker is worth (the learned survival)."""
        hint = decision.pull
        if self.planner is None or hint is None or report.outcome != "ok" or not report.tokens:
            return
        kept = realised - hint.start_block * self.block_size
        self.planner.ledger.observe(decision.worker_id, kept / report.tokens, self._clock())

    def check_parity(
        self, request_id: str, router_keys: Sequence[BlockKey], worker_key: BlockKey | None
    ) -> bool:
        """See :func:`router.placement.parity.check_parity`; counts into this router's metrics."""
        return check_parity(request_id, router_keys, worker_key, self.metrics)

    def _cached_tokens(
        self,
        keys: Sequence[BlockKey],
        n_tokens: int,
        ids: list[WorkerId],
        index: Mapping[WorkerId, TierCounts] | None,
    ) -> dict[WorkerId, int | None]:
        """See :func:`router.placement.cached.cached_tokens`; counts the decisions the
        router's pending placements knew more for."""
        if not keys:  # shorter than one block: nothing can hit anywhere
            return dict.fromkeys(ids, 0)
        pending = self.pending.lookup(keys, self._clock())
        weight = self.config.host_hit_weight
        out, assisted = cached_tokens(ids, n_tokens, self.block_size, index, pending, weight)
        self.metrics.pending_assists += assisted
        return out

    def _lookup(
        self, keys: Sequence[BlockKey], candidates: Mapping[WorkerId, WorkerLoad]
    ) -> Mapping[WorkerId, TierCounts] | None:
        """Per-tier counts; from the cheaper device-only lookup when no candidate has a host
        tier (its load says so: ``host_blocks``) or host blocks weigh nothing: the host
        counts are all 0 or unused then, so the decision is the same."""
        source = self.prefix_source
        if source is None:
            return None
        try:
            if self._wants_tiers(candidates):
                return source.lookup_tiers(keys)
            counts = source.lookup(keys)
        except Exception as exc:  # degrade, never fail: route by load
            self._index_error(exc)
            return None
        return device_only(counts)

    def _wants_tiers(self, candidates: Mapping[WorkerId, WorkerLoad]) -> bool:
        return self.config.host_hit_weight > 0 and any(
            load.host_blocks for load in candidates.values()
        )

    def _index_error(self, exc: Exception) -> None:
        if isinstance(exc, CircuitOpen):  # not asked: the index failed moments ago
            self.metrics.index_skipped += 1
            return
        self.metrics.index_errors += 1
        n = self.metrics.index_errors
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, ...: visible but bounded
            log.warning("prefix index unavailable (%d errors), routing by load: %s", n, exc)
