"""When a pull would not pay whatever it is priced at, the planner backs off: the holder
has its cap of pulls in flight (busy), the chosen worker's KV has no room for the run
beside its queue (full; every worker so: the fleet is saturated, nothing is pulled), or its
recent pulls were evicted before their requests ran (the learned survival)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.requests.protocol import PullReport
from router import Reason, RouteRequest
from router.placement.placement_types import Placement, WorkerView
from router.placement.pull import PullPlanner, TransferModel
from router.placement.pull_ledger import PullLedger
from tests.router.harness import MiniCluster, load, tokens
from tests.router.placement.test_pull_pricing import RATE, routing, warm

CHOSE_B = Placement("b", Reason.LOAD, 0)


def planner(max_per_source: int = 2, fixed_s: float = 0.01, per_token_s=2e-6) -> PullPlanner:
    return PullPlanner(
        TransferModel(fixed_s, per_token_s),
        prefill_tokens_per_s=RATE,
        min_pull_tokens=64,
        min_deadline_s=0.05,
        block_size=16,
        max_pulls_per_source=max_per_source,
        ledger=PullLedger(alpha=0.5, recovery_s=10.0),
    )


def views(b_queued: int = 0, b_free: int = 1000) -> list[WorkerView]:
    """Holder "a" (125 blocks: 2000 tokens, 5 s of queue), "b" the policy's choice."""
    return [WorkerView("a", load(5000), 2000), WorkerView("b", load(b_queued, free=b_free), 0)]


HELD = {"a": (125, 125), "b": (0, 0)}


def plan(p: PullPlanner, vs: list[WorkerView] | None = None, now: float = 0.0):
    return p.plan(2050, vs or views(), CHOSE_B, HELD, holder_eligible=True, now=now)


def test_a_pull_needs_room_for_its_run_and_its_tail_beside_the_queue() -> None:
    """125 blocks to pull and 50 tokens (4 blocks) to compute: 129 free blocks are enough,
    128 are not; 32 queued tokens on b take 2 of them."""
    p = planner()
    assert plan(p, views(b_free=129))[1] is not None
    placement, hint, priced = plan(p, views(b_free=128))
    assert hint is None and placement == CHOSE_B  # recomputed where the policy put it
    assert priced is not None and priced.choice == "recompute" and priced.pull_s is None
    assert plan(p, views(b_queued=32, b_free=131))[1] is not None
    assert plan(p, views(b_queued=33, b_free=131))[1] is None
    assert p.choices == {"pull": 2, "full": 2}


def test_blocks_its_waiting_requests_will_pin_count_against_a_workers_room() -> None:
    """b reports 7 of its free blocks as the cached prefixes of its waiting requests:
    the boundary of the test above moves by exactly 7 (136 free pull, 135 do not)."""

    def pinned(b_free: int) -> list[WorkerView]:
        a, b = views(b_free=b_free)
        return [
            a,
            dataclasses.replace(b, load=dataclasses.replace(b.load, waiting_pinned_blocks=7)),
        ]

    p = planner()
    assert plan(p, pinned(136))[1] is not None
    placement, hint, _ = plan(p, pinned(135))
    assert hint is None and placement == CHOSE_B
    assert plan(p, views(b_free=135))[1] is not None  # without them, 135 is room enough
    assert p.choices == {"pull": 2, "full": 1}


def test_a_worker_admitting_cached_prefixes_first_has_room_beside_its_uncached_queue() -> None:
    """b queues 3,200 uncached tokens (200 blocks) with 131 free: a strict engine would
    allocate them before the pulled request runs (full); one admitting cached prefixes first
    runs it before them, so only its own 129 blocks count."""

    def cached_first(b_free: int) -> list[WorkerView]:
        a, b = views(b_queued=3200, b_free=b_free)
        return [a, dataclasses.replace(b, load=dataclasses.replace(b.load, admits_cached_first=1))]

    p = planner()
    assert plan(p, views(b_queued=3200, b_free=131))[1] is None
    assert plan(p, cached_first(129))[1] is not None
    assert plan(p, cached_first(128))[1] is None  # its own run and tail still need room
    assert p.choices == {"pull": 1, "full": 2}


def test_pulls_landing_on_a_worker_count_against_its_room() -> None:
    p = planner()
    first = plan(p, views(b_free=250))[1]
    assert first is not None
    ticket = p.ledger.begin(first.source_id, "b", first.num_blocks)
    assert plan(p, views(b_free=250))[1] is None  # 250 - 125 landing < 129
    p.ledger.end(ticket)  # its request runs: its blocks are pinned, the heartbeat shows it
    assert plan(p, views(b_free=250))[1] is not None
    assert p.choices == {"pull": 2, "full": 1}


def test_a_holder_with_its_cap_of_pulls_in_flight_is_not_pulled_from() -> None:
    """Exports queue on the holder: one in flight doubles the move's price, two (the cap)
    stop pulls from it until one is reported."""
    p = planner(max_per_source=2)
    one = plan(p)[1]
    assert one is not None and one.priced_s == pytest.approx(0.01 + 2000 * 2e-6)
    t1 = p.ledger.begin("a", "b", 0)
    two = plan(p)[1]
    assert two is not None and two.priced_s == pytest.approx(2 * (0.01 + 2000 * 2e-6))
    t2 = p.ledger.begin("a", "c", 0)
    assert plan(p)[1] is None
    assert p.choices["busy"] == 1
    p.ledger.landed(t2)  # reported: its export is done, its blocks still landing
    assert p.ledger.exporting["a"] == 1 and plan(p)[1] is not None
    p.ledger.end(t1)
    p.ledger.end(t1)  # idempotent
    assert p.ledger.exporting == {} and p.ledger.in_flight() == 1


def test_missed_pulls_price_their_destination_out_until_they_recover() -> None:
    """A 0.5 s pull of a 2000-token prefix (2 s to recompute) to b, whose pulls were
    evicted before their requests ran: the lost share of the gain is priced as recomputed.
    One miss (alpha 0.5): survival 0.5, the pull costs 0.5 + 0.05 + 1 s, beats 2.05 s;
    three: 0.125, 0.55 + 1.75 s: recompute wins. One half-life (10 s) later the shortfall
    has halved (0.4375 lost): pulled to again; a pull used whole lifts it further."""
    p = planner(fixed_s=0.5, per_token_s=0.0)
    p.ledger.observe("b", 0.0, now=0.0)
    assert plan(p, now=0.0)[1] is not None
    p.ledger.observe("b", 0.0, now=0.0)
    p.ledger.observe("b", 0.0, now=0.0)
    assert p.ledger.survival("b", 0.0) == pytest.approx(0.125)
    _, hint, priced = plan(p, now=0.0)
    assert hint is None and priced is not None and priced.choice == "recompute"
    assert priced.pull_s == pytest.approx(0.55 + 0.875 * 2.0)
    assert priced.recompute_s == pytest.approx(2.05)
    assert p.ledger.survival("b", 10.0) == pytest.approx(1 - 0.875 / 2)
    _, hint, priced = plan(p, now=10.0)
    assert hint is not None and priced.pull_s == pytest.approx(0.55 + 0.4375 * 2.0)
    p.ledger.observe("b", 1.0, now=10.0)  # a pull that was used whole
    assert p.ledger.survival("b", 10.0) == pytest.approx(1 - 0.4375 / 2)
    assert p.choices == {"pull": 2, "recompute": 1}


def test_a_saturated_fleet_pulls_nothing_and_an_idle_one_pulls() -> None:
    """The holder is saturated (5 s of queue), and so is every other worker's KV (each
    has 20 free blocks): the request recomputes on the least loaded; with room, it pulls."""
    cluster = MiniCluster(3, routing("least_loaded", source_step_tokens=0))
    prompt = tokens(1, 2000)
    holder = warm(cluster, prompt)
    loads = {w: load(5000 if w == holder else 100 * i, free=20) for i, w in enumerate(cluster.kv)}
    d = cluster.router.route(RouteRequest("r", prompt + tokens(2, 50)), loads)
    assert d.pull is None and d.worker_id != holder and d.cached_tokens_expected == 0
    assert cluster.router.planner.choices["full"] == 1
    roomy = {w: load(5000 if w == holder else 100 * i) for i, w in enumerate(cluster.kv)}
    d = cluster.router.route(RouteRequest("r2", prompt + tokens(3, 50)), roomy)
    assert d.pull is not None and d.pull.source_id == holder and d.pull_ticket is not None


def test_the_router_ledger_follows_its_pulls_report_and_first_token() -> None:
    """A pulled placement opens a ledger entry; the worker's report frees the source, the
    first token ends it and teaches the survival: a hit of the prefix before the import
    only (the import was evicted) is a survival of 0, a failed pull too."""
    cluster = MiniCluster(2, routing("least_loaded", source_step_tokens=0, alpha=0.5))
    router = cluster.router
    prompt = tokens(1, 2000)
    holder = warm(cluster, prompt)
    loads = {w: load(5000 if w == holder else 0) for w in cluster.kv}
    d = router.route(RouteRequest("r", prompt + tokens(2, 50)), loads)
    assert d.pull is not None and d.pull_ticket is not None
    ledger = router.planner.ledger
    assert ledger.exporting == {holder: 1} and ledger.landing_blocks == {d.worker_id: 125}
    ok = PullReport(holder, "ok", 125, 2000, 0.05)
    router.pull_reported(d, ok)
    assert ledger.exporting == {} and ledger.landing_blocks == {d.worker_id: 125}
    router.pull_used(d, ok, 0)  # the import was gone when the request ran
    router.settle(d)
    assert ledger.in_flight() == 0 and ledger.landing_blocks == {}
    assert ledger.survival(d.worker_id, cluster.now) == pytest.approx(0.5)
    d2 = router.route(RouteRequest("r2", prompt + tokens(3, 50)), loads)
    assert d2.pull is not None
    router.pull_reported(d2, PullReport(holder, "timeout", 0, 0, 2.0))
    assert ledger.survival(d2.worker_id, cluster.now) == pytest.approx(0.25)
    router.pull_used(d2, PullReport(holder, "timeout", 0, 0, 2.0), 0)  # nothing more
    assert ledger.survival(d2.worker_id, cluster.now) == pytest.approx(0.25)
