"""The router's pull pricing: hold at an idle holder, pull to a less loaded worker when the
holder is saturated, recompute a tiny prefix; the transfer model's calibration and
refinement; the pulled column of the predicted-vs-realised table."""

from __future__ import annotations

import pytest

from router import Reason, RouteRequest, RoutingConfig
from router.placement.placement_types import Placement, WorkerView
from router.placement.prediction import PredictionTracker
from router.placement.pull import PullPlanner, TransferModel
from tests.router.harness import MiniCluster, load, tokens

RATE = 1000.0  # prefill tokens per second


def routing(policy: str = "prefix_affinity", **pull) -> RoutingConfig:
    pull = {
        "enabled": True,
        "prefill_tokens_per_s": RATE,
        "fixed_s": 0.01,
        "source_step_tokens": 256,  # the holder's step in flight: 0.256 s
        **pull,
    }
    return RoutingConfig(policy=policy, seed=1, pull=pull, pending_ttl_s=0)


def warm(cluster: MiniCluster, prompt: list[int]) -> str:
    """Place ``prompt`` once (its blocks become cached on the chosen worker); its holder."""
    holder = cluster.place("warm", prompt).worker_id
    cluster.drain(10**9)
    return holder


def test_idle_holder_gets_the_request() -> None:
    cluster = MiniCluster(3, routing())
    prompt = tokens(1, 2000)
    holder = warm(cluster, prompt)
    d = cluster.place("r", prompt + tokens(2, 50))
    assert (d.worker_id, d.reason, d.pull) == (holder, Reason.PREFIX, None)


def test_saturated_holder_makes_the_router_pull_to_another_worker() -> None:
    cluster = MiniCluster(3, routing())
    prompt = tokens(1, 2000)
    holder = warm(cluster, prompt)
    cluster.queue[holder] = 5000  # 5 s of queue; recomputing 2000 tokens costs 2 s
    d = cluster.router.route(RouteRequest("r", prompt + tokens(2, 50)), cluster.loads())
    assert d.reason == Reason.PULL and d.worker_id != holder
    assert d.pull is not None and d.pull.source_id == holder
    assert (d.pull.start_block, d.pull.num_blocks) == (0, 125)  # 2000 cached tokens
    assert d.cached_tokens_expected == 2000
    # priced: half the holder's step in flight (what is left of it on average), fixed 10 ms,
    # 2000 x 2 us; its soft deadline is the break-even (recomputing the pulled tokens)
    assert d.pull.priced_s == pytest.approx(0.256 / 2 + 0.01 + 2000 * 2e-6)
    assert d.pull.deadline_s == pytest.approx(2000 / RATE)
    assert cluster.router.metrics.count(Reason.PULL) == 1


def test_a_holder_busy_with_long_steps_is_not_pulled_from() -> None:
    """The export waits for the rest of the holder's step in flight: 5000-token steps at
    1000 tokens/s leave 2.5 s on average, more than recomputing (2 s): recompute elsewhere."""
    cluster = MiniCluster(3, routing(source_step_tokens=5000))
    prompt = tokens(1, 2000)
    holder = warm(cluster, prompt)
    cluster.queue[holder] = 5000
    d = cluster.router.route(RouteRequest("r", prompt + tokens(2, 50)), cluster.loads())
    assert d.pull is None and d.worker_id != holder and d.cached_tokens_expected == 0


def test_slow_transfers_make_recompute_or_hold_win() -> None:
    """The same saturated holder, but a pull costs more than recomputing: recompute
    elsewhere; and with a queue shorter than the pull, hold."""
    cluster = MiniCluster(3, routing(per_token_s=2e-3))  # 2 ms per token: 4 s for 2k tokens
    prompt = tokens(1, 2000)
    holder = warm(cluster, prompt)
    cluster.queue[holder] = 5000
    d = cluster.router.route(RouteRequest("r", prompt + tokens(2, 50)), cluster.loads())
    assert d.pull is None and d.worker_id != holder and d.cached_tokens_expected == 0
    cluster.queue[holder] = 1000  # 1 s queue + 66 ms prefill beats a 2 s recompute
    d = cluster.router.route(RouteRequest("r2", prompt + tokens(3, 50)), cluster.loads())
    assert (d.worker_id, d.pull) == (holder, None)


def test_a_tiny_prefix_is_recomputed_never_pulled() -> None:
    cluster = MiniCluster(3, routing(min_pull_tokens=64))
    prompt = tokens(1, 40)  # 2 blocks
    holder = warm(cluster, prompt)
    cluster.queue[holder] = 10**6
    d = cluster.router.route(RouteRequest("r", prompt + tokens(2, 50)), cluster.loads())
    assert d.pull is None and d.worker_id != holder


def test_least_loaded_pulls_to_the_worker_it_chose() -> None:
    cluster = MiniCluster(2, routing("least_loaded", fixed_s=0.0, source_step_tokens=0))
    prompt = tokens(1, 1000)
    holder = warm(cluster, prompt)
    other = next(w for w in cluster.kv if w != holder)
    cluster.queue[holder] = 10_000
    d = cluster.router.route(RouteRequest("r", prompt + tokens(2, 20)), cluster.loads())
    assert d.worker_id == other and d.pull is not None and d.pull.source_id == holder
    cluster.queue[holder] = 0
    cluster.queue[other] = 10_000  # least-loaded picks the holder: a hit, no pull
    d = cluster.router.route(RouteRequest("r2", prompt + tokens(3, 20)), cluster.loads())
    assert d.worker_id == holder and d.pull is None


def test_pull_off_by_default_never_hashes_for_load_policies() -> None:
    cluster = MiniCluster(2, RoutingConfig(policy="least_loaded"))
    d = cluster.router.route(RouteRequest("r", tokens(1, 100)), {"w0": load(), "w1": load()})
    assert d.keys == () and d.pull is None


def test_transfer_model_calibrates_a_line_and_refines_toward_observed_pulls() -> None:
    model = TransferModel(0.001, 1e-6, cross_node_factor=4.0, alpha=0.5)
    assert model.seconds("a", "b", 1000) == pytest.approx(4 * (0.001 + 1e-3))
    cost = model.calibrate("a", "a", [(0, 0.002), (1000, 0.004), (2000, 0.006)])
    assert (cost.fixed_s, cost.per_token_s) == (pytest.approx(0.002), pytest.approx(2e-6))
    for _ in range(30):
        model.observe("a", "a", 1000, 0.008)  # twice the calibrated 4 ms
    assert model.seconds("a", "a", 1000) == pytest.approx(0.008, rel=1e-3)
    assert model.pair("a", "a").observed == 30
    with pytest.raises(ValueError, match="at least one"):
        model.calibrate("a", "b", [])


def test_prediction_table_counts_pull_misses_and_slow_pulls() -> None:
    table = PredictionTracker(16)
    table.observe_pull("w1", 320, 320, 0.01, 0.01, slow_factor=2.0)
    table.observe_pull("w1", 320, 0, 0.5, 0.01, slow_factor=2.0)  # missed, and slow
    table.observe_pull("w1", 320, 160, 0.015, 0.01, slow_factor=2.0)  # half missed
    w = table.workers["w1"]
    assert (w.pulls, w.pull_planned_tokens, w.pulled_tokens) == (3, 960, 480)
    assert (w.pull_misses, w.pull_slow) == (2, 1)
    assert table.pull_totals()["pull_misses"] == 2
    # priced 3 x 10 ms, taken 10 + 500 + 15 ms
    assert table.pull_totals()["pull_time_priced_ms"] == 30
    assert table.pull_totals()["pull_time_taken_ms"] == 525


# the policy ruled the busy holder "a" out (its load bound) and chose "b": pull or recompute
CHOSE_B = Placement("b", Reason.LOAD, 0)


def test_a_holder_the_policy_chose_keeps_the_request() -> None:
    """Affinity stays primary: even with 5 s of queue, "a" keeps what the policy gave it
    (moving it would copy the prefix into b's cache, evicting b's own)."""
    views, held = _views((0, 0))
    chosen = Placement("a", Reason.PREFIX, 2000)
    planner = _planner()
    assert planner.plan(2050, views, chosen, held, holder_eligible=True) == (chosen, None, None)
    assert planner.choices == {"hold": 1}


def _planner() -> PullPlanner:
    return PullPlanner(
        TransferModel(0.01, 2e-6),
        prefill_tokens_per_s=RATE,
        min_pull_tokens=64,
        min_deadline_s=0.05,
        block_size=16,
        source_step_tokens=256,
    )


def _views(dest_held: tuple[int, int]) -> tuple[list[WorkerView], dict[str, tuple[int, int]]]:
    """Holder "a" (125 device blocks, 5 s of queue), "b" idle holding ``dest_held`` (device,
    either tier) with its host blocks weighted 0.5 as the router weighs them, "c" busy."""
    dev, both = dest_held
    views = [
        WorkerView("a", load(5000), 2000),
        WorkerView("b", load(0), int((dev + 0.5 * (both - dev)) * 16)),
        WorkerView("c", load(3000), 0),
    ]
    return views, {"a": (125, 125), "b": dest_held, "c": (0, 0)}


def test_a_pull_starts_past_what_the_destination_holds_in_its_host_tier() -> None:
    views, held = _views((1, 100))  # b: block 0 on its device, 1-99 in its host tier
    placement, hint, priced = _planner().plan(2050, views, CHOSE_B, held, holder_eligible=True)
    assert placement == Placement("b", Reason.PULL, 2000)
    assert hint is not None and (hint.source_id, hint.start_block, hint.num_blocks) == (
        "a",
        100,
        25,
    )
    assert hint.priced_s == pytest.approx(0.256 / 2 + 0.01 + 400 * 2e-6)  # 25 blocks moved
    assert priced is not None
    assert priced.recompute_s == pytest.approx((2050 - 1600) / RATE)  # host blocks are hits


def test_a_few_blocks_past_a_host_held_prefix_are_recomputed_not_pulled() -> None:
    """b holds 120 of the 125 blocks (119 in its host tier): recomputing 5 blocks (80 ms)
    beats waiting for the holder's step in flight (256 ms); counting b's host blocks at the
    routing's 0.5 weight would price the recompute at 1 s and pull."""
    views, held = _views((1, 120))
    placement, hint, priced = _planner().plan(2050, views, CHOSE_B, held, holder_eligible=True)
    assert hint is None and priced is not None and priced.choice == "recompute"
    assert placement.worker_id == "b"
    assert priced.recompute_s == pytest.approx((2050 - 1920) / RATE)


def test_a_pull_soft_deadline_covers_the_holder_whole_step_in_flight() -> None:
    """12 blocks to pull: 138 ms priced (half the 256 ms step, 10 ms, 192 x 2 us) beats
    recomputing them (192 ms), but a live holder may take its whole step: the deadline
    allows that (266 ms) rather than give up at the break-even."""
    views, held = _views((113, 113))
    placement, hint, priced = _planner().plan(2050, views, CHOSE_B, held, holder_eligible=True)
    assert placement.worker_id == "b" and hint is not None and hint.num_blocks == 12
    assert hint.priced_s == pytest.approx(0.128 + 0.01 + 192 * 2e-6)
    assert hint.deadline_s == pytest.approx(0.256 + 0.01 + 192 * 2e-6)


def test_nothing_to_pull_is_counted_as_local_pending_or_cold() -> None:
    """No pull priced (a load-only policy chose b): b holds what a holds (local), a
    placement of the prefix on b is in flight (pending: its device count covers the run,
    its blocks do not exist yet), or no worker holds any of it (cold)."""
    planner = _planner()
    views, held = _views((125, 125))
    assert planner.plan(2050, views, CHOSE_B, held, holder_eligible=False)[1] is None
    views, held = _views((125, 0))  # pending on b: the device count, no block held
    assert planner.plan(2050, views, CHOSE_B, held, holder_eligible=False)[1] is None
    cold = {w: (0, 0) for w in held}
    assert planner.plan(2050, views, CHOSE_B, cold, holder_eligible=False)[1] is None
    assert planner.choices == {"local": 1, "pending": 1, "cold": 1}


def test_a_load_only_policy_holds_at_a_holder_whose_wait_beats_recomputing() -> None:
    """least_loaded picks the idle worker, but the holder's 300 ms queue and 20-token tail
    end before a 1 s recompute there: hold, although the pull (2 ms) is priced cheaper —
    affinity stays primary (a pull's copy costs the destination capacity its price omits)."""
    cluster = MiniCluster(2, routing("least_loaded", fixed_s=0.0, source_step_tokens=0))
    prompt = tokens(1, 1000)
    holder = warm(cluster, prompt)
    cluster.queue[holder] = 300
    d = cluster.router.route(RouteRequest("r", prompt + tokens(2, 20)), cluster.loads())
    assert (d.worker_id, d.reason, d.pull) == (holder, Reason.PREFIX, None)
    assert d.cached_tokens_expected == 992  # 62 whole blocks of the 1000 cached tokens
    assert cluster.router.planner is not None
    assert cluster.router.planner.choices["hold"] == 1


def test_a_load_only_policy_holds_only_within_its_request_bound() -> None:
    """The same cheap hold, but the holder runs 9 requests more than least_loaded's choice
    (bound 8): holding would herd, so the request pulls to the chosen worker."""
    planner = _planner()
    views = [
        WorkerView("a", load(100, running=9), 2000),
        WorkerView("b", load(0), 0),
    ]
    held = {"a": (125, 125), "b": (0, 0)}
    placement, hint, priced = planner.plan(2050, views, CHOSE_B, held, holder_eligible=False)
    assert priced is not None and priced.hold_s is None and priced.choice == "pull"
    assert placement.worker_id == "b" and hint is not None and hint.source_id == "a"
    views[0] = WorkerView("a", load(100, running=8), 2000)
    placement, hint, priced = planner.plan(2050, views, CHOSE_B, held, holder_eligible=False)
    assert priced is not None and priced.choice == "hold"
    assert priced.hold_s == pytest.approx((100 + 50) / RATE)
    assert (placement.worker_id, placement.reason, hint) == ("a", Reason.PREFIX, None)
    assert planner.choices == {"pull": 1, "hold": 1}


def test_a_load_only_policy_holds_at_the_holder_that_ends_first() -> None:
    """a holds the whole prefix but has 3 s of queue; c holds 100 of its 125 blocks with an
    empty queue: holding at c (recompute 450 tokens) ends before holding at a or recomputing
    all of it on b."""
    planner = _planner()
    views = [
        WorkerView("a", load(3000), 2000),
        WorkerView("b", load(0), 0),
        WorkerView("c", load(0), 1600),
    ]
    held = {"a": (125, 125), "b": (0, 0), "c": (100, 100)}
    placement, hint, priced = planner.plan(2050, views, CHOSE_B, held, holder_eligible=False)
    assert priced is not None and priced.choice == "hold"
    assert priced.hold_s == pytest.approx((2050 - 1600) / RATE)
    assert (placement.worker_id, placement.cached_tokens_expected, hint) == ("c", 1600, None)
