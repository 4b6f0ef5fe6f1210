"""The Router around the policies: hashing, index + pending merge, degradation, parity,
metrics — with real KV managers feeding a real in-memory index."""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest

from router import (
    NoWorkersError,
    PendingPlacements,
    PrefixSource,
    PrefixSourceUnavailable,
    Reason,
    Router,
    RouteRequest,
    RoutingConfig,
)
from tests.router.harness import MiniCluster, load, tokens
from worker.kv import HashContext, block_keys

AFFINITY = RoutingConfig(policy="prefix_affinity", seed=3)


class Down(PrefixSource):
    """A prefix source whose backend is unreachable."""

    def lookup(self, keys):  # noqa: ANN001, ANN201
        raise PrefixSourceUnavailable("connection refused")


def test_router_hashes_with_the_engines_function_and_reads_the_index() -> None:
    cluster = MiniCluster(3, AFFINITY)
    ctx = HashContext("m", cache_salt="tenant-a")
    prompt = tokens(1, 200)
    first = cluster.place("a", prompt, ctx)
    assert first.keys == tuple(block_keys(prompt, 16, ctx))  # the engine's own keys
    cluster.drain(10_000)
    again = cluster.place("b", prompt + tokens(2, 40), ctx)
    # 12 full blocks of the shared 200 tokens are cached (192 tokens) on the first worker.
    assert (again.worker_id, again.reason, again.cached_tokens_expected) == (
        first.worker_id,
        Reason.PREFIX,
        192,
    )
    # Another tenant's salt changes every key: no hit, routed by load.
    other = cluster.place("c", prompt + tokens(2, 40), HashContext("m", cache_salt="tenant-b"))
    assert other.cached_tokens_expected == 0 and other.reason == Reason.LOAD


@pytest.mark.parametrize("source", [None, Down()], ids=["no-index", "index-down"])
def test_without_index_routes_by_load_and_counts_it(source: PrefixSource | None) -> None:
    router = Router(AFFINITY, source, block_size=16)
    loads = {"w0": load(900), "w1": load(100), "w2": load(500)}
    decision = router.route(RouteRequest("r", tokens(1, 100)), loads)
    assert (decision.worker_id, decision.reason) == ("w1", Reason.NO_INDEX)
    assert router.metrics.count(Reason.NO_INDEX, "prefix_affinity") == 1
    assert router.metrics.index_errors == (1 if source is not None else 0)


def test_empty_index_before_any_event_is_no_index() -> None:
    cluster = MiniCluster(2, AFFINITY, deliver_events=False)
    decision = cluster.place("a", tokens(1, 64))
    assert decision.reason == Reason.NO_INDEX


def test_burst_siblings_land_together_before_events_arrive() -> None:
    # 8 siblings: a 4096-token shared document + 64 own tokens, arriving together; the
    # worker's KV events are still in flight, only the pending placements know.
    def burst(ttl: float) -> Counter[str]:
        cfg = RoutingConfig(
            policy="prefix_affinity", pending_ttl_s=ttl, prefix_affinity={"prefill_weight": 2.0}
        )
        cluster = MiniCluster(4, cfg, deliver_events=False)
        doc = tokens(7, 4096)
        return Counter(
            cluster.place(f"s{i}", doc + tokens(100 + i, 64)).worker_id for i in range(8)
        )

    together = burst(ttl=5.0)
    assert len(together) == 1 and sum(together.values()) == 8
    assert len(burst(ttl=0.0)) > 1  # without pending placements they scatter


def test_pending_placements_expire() -> None:
    cluster = MiniCluster(2, AFFINITY, deliver_events=False)
    doc = tokens(7, 1024)
    cluster.place("a", doc)
    assert cluster.router.pending.lookup(block_keys(doc, 16), cluster.now) != {}
    cluster.now += AFFINITY.pending_ttl_s + 0.01
    assert cluster.router.pending.lookup(block_keys(doc, 16), cluster.now) == {}
    assert len(cluster.router.pending) == 0


def test_a_settled_placement_ends_its_claim_soon_not_at_its_ttl() -> None:
    # ttl 10 s, settle 1 s: a placement's first token ends its claim a second later, so
    # the index (which knows by then whether the blocks stayed) decides from then on
    cfg = RoutingConfig(policy="prefix_affinity", pending_ttl_s=10.0, pending_settle_s=1.0)
    cluster = MiniCluster(2, cfg, deliver_events=False)
    doc = tokens(7, 1024)
    keys = block_keys(doc, 16)
    first = cluster.place("a", doc)
    cluster.now += 2.0
    cluster.router.settle(first)
    assert cluster.router.pending.lookup(keys, cluster.now) == {first.worker_id: 64}
    cluster.now += 1.01
    assert cluster.router.pending.lookup(keys, cluster.now) == {}
    assert len(cluster.router.pending) == 0
    cluster.router.settle(first)  # settled twice, or after its end: nothing happens
    assert len(cluster.router.pending) == 0


def test_a_claim_lasts_while_any_of_its_placements_is_in_flight() -> None:
    pending = PendingPlacements(ttl_s=10.0, settle_s=1.0)
    a, b = block_keys(tokens(1, 64), 16), block_keys(tokens(1, 32), 16)  # b: a's first half
    t_a = pending.record("w0", a, now=0.0)
    t_b = pending.record("w0", b, now=0.5)
    pending.settle(t_a, now=1.0)  # b's placement keeps the first two blocks claimed
    assert pending.lookup(a, now=2.5) == {"w0": 2}
    pending.settle(t_b, now=3.0)
    assert pending.lookup(a, now=3.9) == {"w0": 2}
    assert pending.lookup(a, now=4.01) == {}
    # an unsettled placement still ends at its TTL; settling it afterwards is a no-op, and
    # nothing of it is left behind
    t_c = pending.record("w1", a, now=5.0)
    assert pending.lookup(a, now=14.9) == {"w1": 4}
    assert pending.lookup(a, now=15.01) == {} and len(pending) == 0
    pending.settle(t_c, now=16.0)
    assert len(pending) == 0 and not pending._in_flight and not pending._unsettled


def test_a_later_placement_outlives_an_earlier_ones_settle() -> None:
    pending = PendingPlacements(ttl_s=10.0, settle_s=1.0)
    keys = block_keys(tokens(3, 64), 16)
    t1 = pending.record("w0", keys, now=0.0)
    pending.settle(t1, now=0.5)
    pending.record("w0", keys, now=1.0)  # a sibling placed after the first settled
    assert pending.lookup(keys, now=5.0) == {"w0": 4}  # its own TTL, not t1's settle
    assert pending.lookup(keys, now=11.01) == {}


def test_shared_system_prompt_does_not_herd() -> None:
    # Every prompt = the same 2048-token system prompt + 1024 own tokens. The first worker to
    # cache the system prompt must not attract everything: load spreads, and the system
    # prompt ends up replicated on every worker.
    cluster = MiniCluster(4, AFFINITY, num_blocks=8192)
    system = tokens(1, 2048)
    placed = Counter()
    for i in range(64):
        placed[cluster.place(f"r{i}", system + tokens(1000 + i, 1024)).worker_id] += 1
        cluster.drain(300)  # per worker and arrival: it takes all four to keep up
    assert set(placed) == {"w0", "w1", "w2", "w3"}
    assert max(placed.values()) <= 1.25 * 16
    sys_key = block_keys(system, 16)[-1]
    assert all(cluster.index.lookup([sys_key]).get(w) == 1 for w in cluster.kv)


def test_hot_prefix_is_replicated_while_load_stays_bounded() -> None:
    # A hot 20000-token prefix: serving it from its holder costs 16 tokens per request, but
    # the holder's queue grows; past the load bound the next request goes elsewhere.
    cfg = RoutingConfig(policy="prefix_affinity", prefix_affinity={"balance_abs_tokens": 4096})
    cluster = MiniCluster(4, cfg, num_blocks=16384)
    hot = tokens(5, 20_000)
    holders, peak = set(), 0
    for i in range(40):
        holders.add(cluster.place(f"h{i}", hot + tokens(2000 + i, 512)).worker_id)
        loads = list(cluster.queue.values())
        peak = max(peak, max(loads) - sum(loads) / 4)
    assert len(holders) >= 2
    assert peak <= 4096 + 20_512 + 1  # bound + one request's prompt at most


def test_parity_mismatch_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    router = Router(AFFINITY, block_size=16)
    prompt = tokens(3, 100)
    good = block_keys(prompt, 16, HashContext("m"))
    assert router.check_parity("ok", good, good[-1])
    wrong_salt = block_keys(prompt, 16, HashContext("m", cache_salt="x"))
    with caplog.at_level(logging.ERROR, logger="router.placement.parity"):
        assert not router.check_parity("bad", good, wrong_salt[-1])
        assert not router.check_parity("bad2", good, None)
    assert (router.metrics.parity_checks, router.metrics.parity_mismatches) == (3, 2)
    assert "parity mismatch #1" in caplog.text and "cache_salt" in caplog.text


def test_metrics_snapshot_and_errors() -> None:
    router = Router(RoutingConfig(policy="round_robin"), block_size=16)
    with pytest.raises(NoWorkersError, match="no live worker"):
        router.route(RouteRequest("r", [1, 2, 3]), {})
    calls = []  # each route call's own duration, measured around it
    for i in range(3):
        t0 = time.perf_counter()
        router.route(RouteRequest(f"r{i}", [1, 2, 3]), {"a": load(), "b": load()})
        calls.append(time.perf_counter() - t0)
    snap = router.metrics.snapshot()
    assert snap["decisions"] == {"round_robin/round-robin": 3}
    # each decision's latency is measured, in seconds, within its own call
    samples = router.metrics.latency.latest(3)
    assert router.metrics.latency.count == 3
    assert all(0 < s <= c for s, c in zip(samples, calls, strict=True)), (samples, calls)
    assert snap["decision_latency_p50_s"] == sorted(samples)[1]
    assert snap["decision_latency_p99_s"] == max(samples)
    assert snap["decision_latency_mean_s"] == pytest.approx(sum(samples) / 3)


def test_prompt_shorter_than_a_block_needs_no_index() -> None:
    router = Router(AFFINITY, Down(), block_size=16)
    decision = router.route(RouteRequest("r", [1, 2, 3]), {"w0": load(5), "w1": load(1)})
    assert (decision.worker_id, decision.reason, decision.keys) == ("w1", Reason.LOAD, ())
    assert router.metrics.index_errors == 0
