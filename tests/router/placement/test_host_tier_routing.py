"""Tier-aware routing: the in-memory index keeps each worker's host-tier keys apart, a lookup
returns (device, host) leading counts, and the router weighs a host block as a fraction of a
device hit — above a miss, below a device hit."""

from __future__ import annotations

import pytest

from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from router import InMemoryPrefixIndex, KVIndexSource, Reason, Router, RoutingConfig
from router.placement.placement_types import RouteRequest
from tests.kvstore.helpers import tiers
from tests.redis_server import RedisServer
from tests.router.harness import load, tokens
from worker.kv import HashContext, KVCacheManager, block_keys

CTX = HashContext("m")


def _evicted_to_host(prompt: list[int]) -> KVCacheManager:
    """A worker whose device cache (8 blocks) evicted ``prompt`` into its host tier."""
    kv = KVCacheManager(8, 16, host_num_blocks=16)
    kv.allocate_slots("a", prompt, len(prompt), ctx=CTX)
    kv.free("a")
    other = tokens(99, 128)
    kv.allocate_slots("b", other, len(other), ctx=CTX)  # 8 blocks: evicts all of prompt
    kv.free("b")
    return kv


def test_index_reports_device_and_host_counts_from_events() -> None:
    prompt = tokens(1, 96)
    keys = block_keys(prompt, 16, CTX)
    index = InMemoryPrefixIndex()
    host_kv = _evicted_to_host(prompt)
    index.apply("h", host_kv.drain_events())
    dev_kv = KVCacheManager(8, 16)
    dev_kv.allocate_slots("a", prompt[:48], 48, ctx=CTX)
    index.apply("d", dev_kv.drain_events())
    assert index.lookup(keys) == {"d": 3}  # the device tier alone, as before
    assert index.lookup_tiers(keys) == {"d": tiers(3, 0), "h": tiers(0, 6)}
    hit = host_kv.lookup_prefix(prompt + [7], CTX)  # the worker agrees: 6 blocks, all host
    assert (hit.num_tokens, hit.num_host_tokens) == (96, 96)
    host_kv.allocate_slots("c", prompt + [7], 1, ctx=CTX, prefix=hit)  # loads them back
    index.apply("h", host_kv.drain_events())
    assert index.lookup_tiers(keys) == {"d": tiers(3, 0), "h": tiers(6, 0)}


def test_router_weighs_a_host_block_between_a_miss_and_a_device_hit() -> None:
    prompt = tokens(1, 96)
    index = InMemoryPrefixIndex()
    index.apply("host", _evicted_to_host(prompt).drain_events())
    index.apply("idle", [])
    candidates = {"host": load(host=16), "idle": load()}
    request = RouteRequest("r", prompt + tokens(2, 20), CTX)
    for weight, expected in ((0.5, 48), (1.0, 96), (0.0, 0)):
        router = Router(RoutingConfig(tier_hit_weights={"host": weight}), index, block_size=16)
        decision = router.route(request, candidates)
        if weight:
            assert (decision.worker_id, decision.reason) == ("host", Reason.PREFIX)
        assert decision.cached_tokens_expected == expected
    # A device hit of the same length beats the host copy.
    dev = KVCacheManager(8, 16)
    dev.allocate_slots("a", prompt, 96, ctx=CTX)
    index.apply("dev", dev.drain_events())
    router = Router(RoutingConfig(tier_hit_weights={"host": 0.5}), index, block_size=16)
    decision = router.route(request, {**candidates, "dev": load()})
    assert (decision.worker_id, decision.cached_tokens_expected) == ("dev", 96)


@pytest.mark.redis
def test_router_over_redis_prefers_a_host_hit_to_a_cold_worker(redis_server: RedisServer) -> None:
    """The same weighing with the Redis index: KVIndexSource feeds
    the router per-tier counts from one lookup, so a host-tier hit is not seen as a miss."""
    config = IndexConfig(url=redis_server.url, cluster="t", model_id="m")
    index = KVIndex(config)
    prompt = tokens(1, 96)
    epochs = {
        w: index.register(w, load=load(host=16 if w == "host" else 0)) for w in ("host", "cold")
    }
    host_kv = _evicted_to_host(prompt)
    assert index.apply_events("host", epochs["host"], 1, host_kv.drain_events()).applied
    assert index.lookup_tiers(block_keys(prompt, 16, CTX)) == {
        "host": tiers(0, 6),
        "cold": tiers(0, 0),
    }
    live = {w: info.load for w, info in index.live_workers().items()}
    request = RouteRequest("r", prompt + tokens(2, 20), CTX)
    for weight, expected in ((0.5, 48), (1.0, 96)):
        router = Router(
            RoutingConfig(tier_hit_weights={"host": weight}), KVIndexSource(index), block_size=16
        )
        decision = router.route(request, live)
        assert (decision.worker_id, decision.reason) == ("host", Reason.PREFIX)
        assert decision.cached_tokens_expected == expected

    # A worker holding the same prefix on its device beats the host copy.
    dev = KVCacheManager(8, 16)
    dev.allocate_slots("a", prompt, 96, ctx=CTX)
    epoch = index.register("dev", load=load())
    assert index.apply_events("dev", epoch, 1, dev.drain_events()).applied
    live = {w: info.load for w, info in index.live_workers().items()}
    router = Router(
        RoutingConfig(tier_hit_weights={"host": 0.5}), KVIndexSource(index), block_size=16
    )
    decision = router.route(request, live)
    assert (decision.worker_id, decision.cached_tokens_expected) == ("dev", 96)
    index.close()
