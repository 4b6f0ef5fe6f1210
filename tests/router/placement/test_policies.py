"""Exact decisions of each policy on small hand-built views (no Redis, no hashing)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from router import (
    PrefixAffinity,
    Reason,
    RouteRequest,
    RoutingConfig,
    UnknownPolicyError,
    WorkerView,
    make_policy,
    policy_names,
)
from router.placement.config import LeastLoadedConfig, PrefixAffinityConfig
from router.placement.policies import LeastLoaded
from tests.router.harness import load

REQ = RouteRequest("r", list(range(10_000)))


def views(*specs: tuple[int, int | None]) -> list[WorkerView]:
    """(queued prefill tokens, cached tokens) per worker w0, w1, ..."""
    return [WorkerView(f"w{i}", load(q), c) for i, (q, c) in enumerate(specs)]


def affinity(**kw: float) -> PrefixAffinity:
    return PrefixAffinity(PrefixAffinityConfig(**kw), random.Random(0))


def test_registry_lists_valid_names_on_unknown_policy() -> None:
    assert policy_names() == ["least_loaded", "prefix_affinity", "round_robin"]
    with pytest.raises(ValidationError, match="least_loaded, prefix_affinity, round_robin"):
        RoutingConfig(policy="longest_prefix")  # the config names the valid ones at load
    with pytest.raises(UnknownPolicyError, match="least_loaded, prefix_affinity, round_robin"):
        make_policy(RoutingConfig.model_construct(policy="longest_prefix"))
    assert make_policy(RoutingConfig(policy="round_robin")).name == "round_robin"


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="extra"):
        RoutingConfig(prefix_affinity={"prefill_wieght": 2.0})


def test_round_robin_cycles_in_id_order() -> None:
    policy = make_policy(RoutingConfig(policy="round_robin"))
    vs = views((0, None), (0, None), (0, None))
    picks = [policy.choose(REQ, vs) for _ in range(4)]
    assert [p.worker_id for p in picks] == ["w0", "w1", "w2", "w0"]
    assert {p.reason for p in picks} == {Reason.ROUND_ROBIN}


def test_least_loaded_two_choices() -> None:
    policy = LeastLoaded(LeastLoadedConfig(choices=2), random.Random(1))
    two = views((500, None), (100, None))
    assert {policy.choose(REQ, two).worker_id for _ in range(20)} == {"w1"}
    # Power of two choices never picks the most loaded of three distinct loads...
    three = views((300, None), (100, None), (200, None))
    picks = [policy.choose(REQ, three).worker_id for _ in range(200)]
    assert "w0" not in picks and {"w1", "w2"} <= set(picks)
    # ... and with d = n it is the exact minimum.
    full = LeastLoaded(LeastLoadedConfig(choices=3), random.Random(1))
    assert {full.choose(REQ, three).worker_id for _ in range(20)} == {"w1"}


def test_least_loaded_counts_decode_load_when_weighted() -> None:
    vs = [WorkerView("w0", load(100, decode=10), None), WorkerView("w1", load(200), None)]
    unweighted = LeastLoaded(LeastLoadedConfig(choices=2), random.Random(0))
    weighted = LeastLoaded(LeastLoadedConfig(choices=2, decode_weight=20), random.Random(0))
    assert unweighted.choose(REQ, vs).worker_id == "w0"  # 100 < 200
    assert weighted.choose(REQ, vs).worker_id == "w1"  # 100 + 200 > 200


def test_prefix_affinity_prefers_cache_while_it_saves_more_than_the_queue() -> None:
    policy = affinity(prefill_weight=1.0)
    # w1: 10000 - 8000 uncached + 1000 queued = 3000 < w0's 10000.
    pick = policy.choose(REQ, views((0, 0), (1000, 8000)))
    assert (pick.worker_id, pick.reason, pick.cached_tokens_expected) == ("w1", Reason.PREFIX, 8000)
    # w1: 2000 + 9000 = 11000 > 10000: the idle worker recomputes.
    pick = policy.choose(REQ, views((0, 0), (9000, 8000)))
    assert (pick.worker_id, pick.reason, pick.cached_tokens_expected) == ("w0", Reason.LOAD, 0)
    # A larger prefill weight values the same hit more: 2 x 2000 + 9000 < 2 x 10000.
    assert affinity(prefill_weight=2.0).choose(REQ, views((0, 0), (9000, 8000))).worker_id == "w1"


def test_prefix_affinity_load_bound_replicates_an_overloaded_holder() -> None:
    policy = affinity(prefill_weight=1.0, balance_slack=0.5, balance_abs_tokens=1000)
    # w0 holds 9900 of 10000 tokens: cost 100 + 6000 = 6100 beats w2's 7000, but its load
    # 6000 is over mean 2000 + max(0.5 x 2000, 1000) = 3000: the cheapest eligible one wins.
    pick = policy.choose(REQ, views((6000, 9900), (0, 0), (0, 3000)))
    assert (pick.worker_id, pick.reason, pick.cached_tokens_expected) == (
        "w2",
        Reason.BALANCE,
        3000,
    )
    # Without the bound (huge slack) the holder wins.
    loose = affinity(prefill_weight=1.0, balance_slack=100.0)
    assert loose.choose(REQ, views((6000, 9900), (0, 0), (0, 3000))).worker_id == "w0"


def test_prefix_affinity_request_bound_spreads_sessions_on_an_idle_cluster() -> None:
    # No queued prefill anywhere, but w0 (holding a 6000-token system prompt) already runs 20
    # requests: over mean 20/3 + max(0.5 x 20/3, 8) = 14.7, so a new session goes elsewhere.
    vs = [
        WorkerView("w0", load(running=20), 6000),
        WorkerView("w1", load(running=0), 0),
        WorkerView("w2", load(running=1), 0),
    ]
    pick = affinity(balance_abs_requests=8).choose(REQ, vs)
    assert (pick.worker_id, pick.reason) in {("w1", Reason.BALANCE), ("w2", Reason.BALANCE)}
    assert affinity(balance_abs_requests=None).choose(REQ, vs).worker_id == "w0"


def test_prefix_affinity_shared_prefix_on_every_worker_routes_by_load() -> None:
    policy = affinity()
    pick = policy.choose(REQ, views((700, 2048), (300, 2048), (500, 2048)))
    assert (pick.worker_id, pick.reason) == ("w1", Reason.LOAD)


def test_prefix_affinity_ties_prefer_cache_then_seeded_random() -> None:
    # Equal cost (w0: 5000 + 5000, w1: 10000 + 0): the one with the cache, less total work.
    pick = affinity(prefill_weight=1.0).choose(REQ, views((5000, 5000), (0, 0)))
    assert (pick.worker_id, pick.reason) == ("w0", Reason.PREFIX)
    # Complete ties: seeded random, so reproducible, and every tied worker gets picked.
    idle = views((0, 0), (0, 0), (0, 0))
    a, b = affinity(), affinity()
    seq_a = [a.choose(REQ, idle).worker_id for _ in range(30)]
    seq_b = [b.choose(REQ, idle).worker_id for _ in range(30)]
    assert seq_a == seq_b and set(seq_a) == {"w0", "w1", "w2"}


def test_prefix_affinity_without_prefix_data_says_no_index() -> None:
    pick = affinity().choose(REQ, views((900, None), (100, None), (500, None)))
    assert (pick.worker_id, pick.reason, pick.cached_tokens_expected) == ("w1", Reason.NO_INDEX, 0)
