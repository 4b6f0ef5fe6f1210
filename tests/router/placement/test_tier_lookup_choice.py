"""The router asks the index for per-tier counts only when a candidate has a host KV tier (its
heartbeat load reports ``host_blocks``) and host blocks weigh something; otherwise it asks for
the cheaper device-only counts. Either way the decision is the one the tier lookup gives."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier, TierBlocks
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from kvstore.index_types import WorkerLoad
from router import InMemoryPrefixIndex, KVIndexSource, Router, RoutingConfig
from router.placement.placement_types import RouteRequest, WorkerId
from router.placement.prefix_source import PrefixSource
from tests.redis_server import RedisServer
from tests.router.harness import load, tokens
from worker.engine import Engine, EngineConfig
from worker.kv import HashContext, KVCacheManager
from worker.status import worker_load

CTX = HashContext("m")


class Spy(PrefixSource):
    """Counts which lookup the router asked for."""

    def __init__(self, inner: PrefixSource) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def lookup(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, int] | None:
        self.calls["lookup"] += 1
        return self.inner.lookup(keys)

    def lookup_tiers(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, TierBlocks] | None:
        self.calls["lookup_tiers"] += 1
        return self.inner.lookup_tiers(keys)


def _device_workers(rng: random.Random) -> tuple[InMemoryPrefixIndex, list[list[int]]]:
    """Three device-only workers holding random prefixes of shared-prefix prompts."""
    index = InMemoryPrefixIndex()
    base = tokens(1, 64)
    prompts = [base[: rng.randrange(16, 64)] + tokens(10 + i, 40) for i in range(12)]
    for w in ("a", "b", "c"):
        kv = KVCacheManager(64, 16)
        for i, p in enumerate(rng.sample(prompts, 4)):
            kv.allocate_slots(f"{w}{i}", p, len(p), ctx=CTX)
            kv.free(f"{w}{i}")
        index.apply(w, kv.drain_events())
    return index, prompts


def _route_all(
    index: PrefixSource, prompts: list[list[int]], loads: dict[str, WorkerLoad], weight: float
) -> tuple[list[tuple], Counter[str]]:
    spy = Spy(index)
    router = Router(RoutingConfig(tier_hit_weights={"host": weight}), spy, block_size=16)
    out = []
    for i, p in enumerate(prompts):
        d = router.route(RouteRequest(f"r{i}", p + [i], CTX), loads)
        out.append((d.worker_id, d.reason, d.cached_tokens_expected))
    return out, spy.calls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_only_candidates_get_the_device_lookup_and_the_same_decisions(seed: int) -> None:
    index, prompts = _device_workers(random.Random(seed))
    plain = {w: load(queued=50 * i) for i, w in enumerate("abc")}
    # the same workers, one of them claiming a host tier: the router must ask per tier
    claimed = {**plain, "b": replace(plain["b"], tier_blocks={Tier.HOST: 32})}
    device, device_calls = _route_all(index, prompts, plain, 0.5)
    tiers, tier_calls = _route_all(index, prompts, claimed, 0.5)
    assert device_calls == {"lookup": len(prompts)}
    assert tier_calls == {"lookup_tiers": len(prompts)}
    assert device == tiers
    assert sum(cached > 0 for _, _, cached in device) >= len(prompts) // 2  # prefixes did hit
    # host blocks that weigh nothing need no tier lookup either
    weightless, calls = _route_all(index, prompts, claimed, 0.0)
    assert calls == {"lookup": len(prompts)} and weightless == device


def test_host_tier_candidate_gets_the_tier_lookup() -> None:
    """A worker whose prefix sits in its host tier is found because its load reports a host
    tier; a load without one would hide that hit (the device lookup sees a miss)."""
    prompt = tokens(1, 96)
    kv = KVCacheManager(8, 16, host_num_blocks=16)
    kv.allocate_slots("a", prompt, len(prompt), ctx=CTX)
    kv.free("a")
    other = tokens(99, 128)
    kv.allocate_slots("b", other, len(other), ctx=CTX)  # evicts prompt into the host tier
    kv.free("b")
    index = InMemoryPrefixIndex()
    index.apply("host", kv.drain_events())
    index.apply("idle", [])
    loads = {"host": load(host=kv.host_num_blocks), "idle": load()}
    got, calls = _route_all(index, [prompt], loads, 0.5)
    assert calls == {"lookup_tiers": 1} and got == [("host", got[0][1], 48)]


def test_engine_load_reports_the_host_tier_size() -> None:
    from tests.engine.fakes import FakeExecutor
    from tests.engine.test_host_tier import HostFakeExecutor

    with_host = Engine(HostFakeExecutor(16, 4, 24), EngineConfig(block_size=4))
    assert (
        worker_load(with_host.snapshot()).tier_blocks.get(Tier.HOST, 0)
        == with_host.kv.host_num_blocks
        == 24
    )
    no_host = Engine(FakeExecutor(16, 4), EngineConfig(block_size=4))
    assert worker_load(no_host.snapshot()).tier_blocks.get(Tier.HOST, 0) == 0


@pytest.mark.redis
def test_over_redis_the_heartbeat_decides_which_script_runs(redis_server: RedisServer) -> None:
    """The fact travels in the registry: loads read back from Redis carry ``tier_blocks``."""
    index = KVIndex(IndexConfig(url=redis_server.url, cluster="choice", model_id="m"))
    prompt = tokens(3, 96)
    dev = KVCacheManager(16, 16)
    dev.allocate_slots("a", prompt[:48], 48, ctx=CTX)
    epoch = index.register("dev", load=load())
    assert index.apply_events("dev", epoch, 1, dev.drain_events()).applied
    index.register("cold", load=load())
    source = Spy(KVIndexSource(index))
    request = RouteRequest("r", prompt + [5], CTX)

    def route():  # noqa: ANN202 - a fresh router: no pending placement of the last call
        live = {w: info.load for w, info in index.live_workers().items()}
        return live, Router(
            RoutingConfig(tier_hit_weights={"host": 0.5}), source, block_size=16
        ).route(request, live)

    _, first = route()
    assert source.calls == {"lookup": 1}
    assert index.heartbeat("cold", index.live_workers()["cold"].epoch, load(host=8))
    live, second = route()
    assert live["cold"].tier_blocks == {Tier.HOST: 8}
    assert source.calls == {"lookup": 1, "lookup_tiers": 1}
    assert (first.worker_id, first.cached_tokens_expected) == ("dev", 48)
    assert (second.worker_id, second.cached_tokens_expected) == ("dev", 48)
    index.close()
