"""prefix_affinity wired to the real Redis KV index (a real redis-server, no fakes)."""

from __future__ import annotations

import pytest

from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from router import KVIndexSource, Reason, Router, RouteRequest, RoutingConfig
from tests.redis_server import RedisServer
from tests.router.harness import load, tokens
from worker.kv import HashContext, KVCacheManager

pytestmark = pytest.mark.redis


def test_prefix_affinity_over_redis_index_and_outage(redis_server: RedisServer) -> None:
    index = KVIndex(IndexConfig(url=redis_server.url, cluster="t", model_id="m"))
    ctx = HashContext("m", cache_salt="tenant")
    kvs = {w: KVCacheManager(256, 16) for w in ("w0", "w1", "w2")}
    epochs = {w: index.register(w, load=load()) for w in kvs}
    # w1 serves a 200-token prompt and publishes its KV events, as its engine would.
    prompt = tokens(1, 200)
    kv = kvs["w1"]
    hit = kv.lookup_prefix(prompt, ctx)
    kv.allocate_slots("first", prompt, len(prompt) - hit.num_tokens, ctx=ctx, prefix=hit)
    assert index.apply_events("w1", epochs["w1"], 1, kv.drain_events()).applied
    for w in kvs:
        assert index.heartbeat(w, epochs[w], load(queued=100 if w == "w1" else 0))

    router = Router(RoutingConfig(), KVIndexSource(index), block_size=16)
    live = {w: info.load for w, info in index.live_workers().items()}
    assert sorted(live) == ["w0", "w1", "w2"]
    follow_up = prompt + tokens(2, 50)
    decision = router.route(RouteRequest("second", follow_up, ctx), live)
    assert (decision.worker_id, decision.reason, decision.cached_tokens_expected) == (
        "w1",
        Reason.PREFIX,
        192,
    )
    # Parity: the worker's block chain for the request equals the router's keys.
    hit = kv.lookup_prefix(follow_up, ctx)
    kv.allocate_slots("second", follow_up, len(follow_up) - hit.num_tokens, ctx=ctx, prefix=hit)
    stored = [k for e in kv.drain_events() for k in getattr(e, "keys", ())]
    assert router.check_parity("second", decision.keys, [*hit.keys, *stored][-1])
    assert router.metrics.parity_mismatches == 0

    # Redis goes away: the router keeps routing, by load, and says so. (A new prompt: the
    # router's own pending placements would still remember where "second" went.)
    redis_server.stop()
    outage = router.route(RouteRequest("third", tokens(3, 300), ctx), live)
    assert (outage.worker_id, outage.reason) in {("w0", Reason.NO_INDEX), ("w2", Reason.NO_INDEX)}
    assert router.metrics.index_errors == 1
    assert router.metrics.count(Reason.NO_INDEX) == 1
