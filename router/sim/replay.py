"""Replay a workload through a real :class:`Router` against simulated workers.

Each worker runs a real KVCacheManager; its KV events are published at the end of the step
that produced them and reach the router's :class:`InMemoryPrefixIndex` ``event_delay_s``
later. Loads are read fresh at every decision (heartbeats are assumed frequent). When the
router prices peer pulls (``routing.pull.enabled``), a pull takes the holder's run from its
real KV manager once the holder's step in flight ends, moves it at the time model's pull
cost, and imports it into the destination's KV manager before the request is queued there.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.blocks.events import KVEvent
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from kvstore.requests.protocol import PullHint
from router.placement.config import RoutingConfig
from router.placement.placement_types import RouteRequest
from router.placement.prefix_source import InMemoryPrefixIndex
from router.placement.router import Router
from router.sim.config import SimConfig
from router.sim.disk_tier import SimDiskTier
from router.sim.records import RequestRecord, SimRequest
from router.sim.worker import SimWorker
from worker.kv import KVCacheManager, TierSpec
from worker.kv.transfer import RunHeader


@dataclass
class ReplayResult:
    """Everything a report needs from one replay."""

    policy: str  # routing policy name
    num_workers: int  # simulated workers
    records: list[RequestRecord]  # one per request, in arrival order
    computed_prefill: dict[str, int]  # prompt tokens each worker computed
    busy_s: dict[str, float]  # time each worker spent in steps
    router_metrics: dict  # RouterMetrics.snapshot()
    wall_s: float  # real seconds the replay took
    index_gaps: int = 0  # KV event gaps the in-memory index saw (must be 0)
    extra: dict = field(default_factory=dict)  # free-form notes


class _Clock:
    """The simulated time, readable by the router (pending-placement TTL)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv_manager(sim: SimConfig) -> KVCacheManager:
    """One simulated worker's real KV manager: its device cache, the host tier and the
    simulated disk tier below it (:class:`~router.sim.disk_tier.SimDiskTier`), lower-tier hits
    priced against recomputing as the engine prices them."""
    bs = sim.block_size
    disk = sim.disk_kv_tokens_per_worker // bs
    lower: tuple[TierSpec, ...] = ()
    if disk:
        options = {
            "load_s_per_token": sim.time.tier_load_s_per_token[Tier.DISK],
            "admit_after": sim.disk_admit_after,
        }
        lower = (TierSpec(SimDiskTier.name, disk, options),)
    return KVCacheManager(
        sim.kv_tokens_per_worker // bs,
        bs,
        host_num_blocks=sim.host_kv_tokens_per_worker // bs,
        lower_tiers=lower,
        recompute_seconds=sim.time.recompute_s if lower else None,
    )


def replay(requests: Iterable[SimRequest], routing: RoutingConfig, sim: SimConfig) -> ReplayResult:
    """Route every request (in arrival order) and simulate the workers until all finish."""
    started = time.perf_counter()
    index = InMemoryPrefixIndex()
    clock = _Clock()
    router = Router(routing, index, block_size=sim.block_size, clock=clock)
    workers = {
        f"w{i:02d}": SimWorker(
            f"w{i:02d}",
            kv_manager(sim),
            sim.time,
            parity=router.check_parity,
            waiting_load=sim.waiting_load,
            max_loras=sim.max_loras,
        )
        for i in range(sim.num_workers)
    }
    inbox: list[tuple[float, int, str, list[KVEvent]]] = []  # (delivery time, order, worker, batch)
    order = 0

    def collect(until: float) -> None:
        nonlocal order
        for wid, worker in workers.items():
            worker.advance(until)
            for published, batch in worker.take_events():
                heapq.heappush(inbox, (published + sim.event_delay_s, order, wid, batch))
                order += 1
        while inbox and inbox[0][0] <= until:
            _, _, wid, batch = heapq.heappop(inbox)
            index.apply(wid, batch)

    records: list[RequestRecord] = []
    pulls: Counter[str] = Counter()
    # (when, ticket, ticket) of each pull in flight: its ledger entry ends when it lands (the
    # simulated worker counts the landed blocks in its load's free blocks from then on)
    landing: list[tuple[float, int, int]] = []
    last_arrival = -math.inf
    for req in requests:
        if req.arrival_s < last_arrival:
            raise ValueError(
                f"requests must be in arrival order; {req.request_id} goes back in time"
            )
        last_arrival = clock.now = req.arrival_s
        collect(req.arrival_s)
        while landing and landing[0][0] <= req.arrival_s:  # those pulls have landed
            router.planner.ledger.end(heapq.heappop(landing)[2])
        decision = router.route(
            RouteRequest(req.request_id, req.token_ids, req.ctx),
            {wid: w.load(req.arrival_s) for wid, w in workers.items()},
        )
        worker = workers[decision.worker_id]
        pull = None
        if decision.pull is not None:
            pull = _pull(decision.pull, decision.keys, req, workers, sim)
            pulls["ok" if pull[1] is not None else "missed"] += 1
            assert router.planner is not None and decision.pull_ticket is not None
            heapq.heappush(landing, (pull[0], decision.pull_ticket, decision.pull_ticket))
        records.append(worker.submit(req, decision.cached_tokens_expected, decision.keys, pull))
    collect(math.inf)
    return ReplayResult(
        policy=routing.policy,
        num_workers=sim.num_workers,
        records=records,
        computed_prefill={wid: w.computed_prefill_tokens for wid, w in workers.items()},
        busy_s={wid: w.busy_s for wid, w in workers.items()},
        router_metrics=router.metrics.snapshot(),
        wall_s=time.perf_counter() - started,
        index_gaps=index.gaps,
        extra={
            "lora_loads": sum(w.lora_loads for w in workers.values()),
            "pulls": dict(pulls),
            "pulled_tokens": sum(r.pulled_tokens for r in records),
        },
    )


def _pull(
    hint: PullHint,
    keys: Sequence[BlockKey],
    req: SimRequest,
    workers: dict[str, SimWorker],
    sim: SimConfig,
) -> tuple[float, RunHeader | None]:
    """When the pull the router asked for ends, and the run it brings (None: it missed, or
    outlasted its soft deadline, and the request recomputes). The source answers once its
    step in flight ends (its load), then the run moves at the pull cost."""
    source = workers[hint.source_id]
    want = keys[hint.start_block : hint.start_block + hint.num_blocks]
    header = source.export_run(want, hint.start_block, req.ctx)
    if header is None:
        return req.arrival_s, None
    tm = sim.time
    tokens = len(header) * sim.block_size
    ready = max(req.arrival_s, source.clock) + tm.pull_fixed_s + tokens * tm.pull_s_per_token
    if ready - req.arrival_s > hint.deadline_s:
        return req.arrival_s + hint.deadline_s, None
    return ready, header
