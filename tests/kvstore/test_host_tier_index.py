"""The Redis index records the host KV tier: per-tier lookups equal the workers' own caches.

Several "workers", each a real :class:`KVCacheManager` with a small device pool and a host
tier, run the random shared-prefix workload of ``test_lookup_modes`` (evictions offload to the
host tier, prefix hits load back from it) and publish their events to a real Redis. After
every round, every prompt is looked up per tier in both lookup modes; for every worker the
answer must be (leading blocks on its device, further leading blocks in its host tier), each
rounded down to ``record_every``. Restarts (a new registration resynced from a snapshot of
both tiers, the old one purged in chunks) and cache resets happen on the way.
"""

from __future__ import annotations

import contextlib
import random
import time

import pytest

from kvstore.config import IndexConfig
from kvstore.events import TierKeys
from kvstore.index import KVIndex
from tests.kvstore.test_lookup_modes import CTX, _prompts, _round, _Worker
from tests.redis_server import RedisServer
from worker.kv import BlockStored, KVCacheManager, block_keys
from worker.kv.invariants import check_prefix_closed, record_parents
from worker.kv.types import KVCapacityError

pytestmark = pytest.mark.redis


class _TierWorker(_Worker):
    def __init__(self, name: str, num_blocks: int, host_blocks: int, index: KVIndex) -> None:
        super().__init__(name, num_blocks, 2, index)
        self.kv = KVCacheManager(num_blocks, 2, host_num_blocks=host_blocks)
        self.hosted = 0  # host-tier stores seen

    def admit(self, sid: int, prompt: list[int], chunk: int) -> None:
        with contextlib.suppress(KVCapacityError):  # longer than the small pool: rejected
            super().admit(sid, prompt, chunk)

    def advance(self, sid: int, chunk: int, rng: random.Random) -> None:
        try:
            super().advance(sid, chunk, rng)
        except KVCapacityError:  # grew past the whole pool: finished
            self.free(sid)

    def publish(self) -> None:
        events = self.kv.drain_events()
        self.hosted += sum(
            len(e.keys) for e in events if isinstance(e, BlockStored) and e.tier == "host"
        )
        self.kv.take_transfers()  # no runner: drop the copies, release pinned host blocks
        self.batch += 1
        assert self.index.apply_events(self.name, self.epoch, self.batch, events).applied
        for e in events:
            record_parents(e, self.parents)
        union = set(self.kv.cached_keys()) | set(self.kv.host_cached_keys())
        check_prefix_closed(union, self.parents)

    def restart(self) -> None:
        """A new registration, resynced from a snapshot of both tiers (the old one is dead)."""
        self.epoch = self.index.register(self.name)
        self.batch = 1
        snap = TierKeys(self.kv.cached_keys(), self.kv.host_cached_keys())
        assert self.index.resync(self.name, self.epoch, 1, snap)

    def truth(self, keys: list[bytes], k: int) -> tuple[int, int]:
        device, host = set(self.kv.cached_keys()), set(self.kv.host_cached_keys())
        d = 0
        while d < len(keys) and keys[d] in device:
            d += 1
        u = d
        while u < len(keys) and keys[u] in host:
            u += 1
        return d // k * k, u // k * k - d // k * k


@pytest.mark.parametrize("record_every", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_tier_lookup_equals_each_workers_tiers(
    redis_server: RedisServer, record_every: int, seed: int
) -> None:
    rng = random.Random(seed)
    make = lambda mode: KVIndex(  # noqa: E731
        IndexConfig(
            url=redis_server.url,
            model_id=f"h{seed}{record_every}",
            record_every=record_every,
            lookup=mode,
        )
    )
    scan, bisect = make("scan"), make("bisect")
    workers = [
        _TierWorker(f"w{i}", rng.randrange(16, 40), rng.randrange(16, 64), scan) for i in range(4)
    ]
    prompts = _prompts(rng)
    sid, host_hits, restarts, resets = 0, 0, 0, 0
    for r in range(30):
        sid = _round(workers, prompts, rng, sid)
        if r % 7 == 3:  # a restart: the old registration's entries are purged in small chunks
            rng.choice(workers).restart()
            restarts += 1
            while scan.purge_dead(chunk=7):
                pass
        if r % 11 == 5:  # a cache reset (every sequence finished first)
            w = rng.choice(workers)
            for s in list(w.seqs):
                w.free(s)
            assert w.kv.reset_prefix_cache()
            w.publish()
            assert not w.index.held_keys(w.name) and not w.index.held_keys(w.name, host=True)
            resets += 1
        for prompt in prompts + [p + [rng.randrange(50)] * 6 for p in prompts[:6]]:
            keys = block_keys(prompt, 2, CTX)
            truth = {w.name: w.truth(keys, record_every) for w in workers}
            assert scan.lookup_tiers(keys) == truth
            assert bisect.lookup_tiers(keys) == truth
            # the device-only lookup is the tier lookup's first count
            assert bisect.lookup(keys) == {w: d for w, (d, _) in truth.items()}
            host_hits += sum(h > 0 for _, h in truth.values())
        for w in workers:  # the index holds exactly each tier's recorded keys
            rec = scan.recorder(w.name)
            assert scan.held_keys(w.name) == set(rec.recorded(w.kv.cached_keys()))
            assert scan.held_keys(w.name, host=True) == set(
                rec.recorded(w.kv.host_cached_keys(), host=True)
            )
    assert host_hits > 50, host_hits  # the workload did put prefixes in host tiers
    assert sum(w.hosted for w in workers) > 50 and restarts and resets
    scan.close()
    bisect.close()


def test_purge_drops_host_entries_and_resync_replaces_them(redis_server: RedisServer) -> None:
    cfg = IndexConfig(url=redis_server.url, model_id="purge-host")
    index = KVIndex(cfg)
    keys = block_keys(list(range(40)), 2, CTX)  # 20 blocks
    epoch = index.register("a")
    # 0..7 on the device, 8..19 in the host tier
    events = [
        BlockStored(0, tuple(keys[:8]), None, (), 2),
        BlockStored(1, tuple(keys[8:]), keys[7], (), 2, "host"),
    ]
    assert index.apply_events("a", epoch, 1, events).applied
    assert index.lookup_tiers(keys) == {"a": (8, 12)}
    assert index.lookup_tiers(keys[:5]) == {"a": (5, 0)}
    # a resync without host keys empties the host tier's entries
    assert index.resync("a", epoch, 2, keys[:10])
    assert index.lookup_tiers(keys) == {"a": (10, 0)}
    assert index.resync("a", epoch, 3, TierKeys(keys[:4], keys[4:15]))
    assert index.lookup_tiers(keys) == {"a": (4, 11)}
    assert index.held_keys("a", host=True) == set(keys[4:15])
    # a restart: the old slot is dead, purged in chunks smaller than either tier
    index.register("a")
    assert index.lookup_tiers(keys) == {"a": (0, 0)}
    assert index.purge_dead(chunk=3) == 1
    client = index.client
    ns = cfg.namespace
    assert client.hlen(ns + "blk") == 0 and client.hlen(ns + "hblk") == 0
    assert not [k for k in client.scan_iter(ns + "*held:*")]
    index.close()


def test_worker_without_device_hit_but_host_hit_is_counted(redis_server: RedisServer) -> None:
    """Host depth continues from device depth 0: a prefix wholly in the host tier counts."""
    index = KVIndex(IndexConfig(url=redis_server.url, model_id="host-only"))
    keys = block_keys(list(range(20)), 2, CTX)
    ea, eb = index.register("a"), index.register("b")
    assert index.apply_events("a", ea, 1, [BlockStored(0, tuple(keys), None, (), 2, "host")])
    assert index.apply_events("b", eb, 1, [BlockStored(0, tuple(keys[:3]), None, (), 2)])
    assert index.lookup_tiers(keys) == {"a": (0, 10), "b": (3, 0)}
    assert index.lookup(keys) == {"a": 0, "b": 3}
    index.close()


@pytest.mark.parametrize("mode", ["bisect", "scan"])
def test_key_in_both_tiers_names_its_worker_once(redis_server: RedisServer, mode: str) -> None:
    """A transient double (a key in both tiers of one worker) must not make that worker count
    as a second candidate: "b" stops at block 5 although "a" holds 5..9 twice."""
    index = KVIndex(IndexConfig(url=redis_server.url, model_id=f"double-{mode}", lookup=mode))
    keys = block_keys(list(range(30)), 2, CTX)  # 15 blocks
    ea, eb = index.register("a"), index.register("b")
    events = [
        BlockStored(0, tuple(keys[:10]), None, (), 2),
        BlockStored(1, tuple(keys[5:]), keys[4], (), 2, "host"),
    ]
    assert index.apply_events("a", ea, 1, events).applied
    assert index.apply_events("b", eb, 1, [BlockStored(0, tuple(keys[:5]), None, (), 2)]).applied
    assert index.lookup_tiers(keys) == {"a": (10, 5), "b": (5, 0)}
    assert index.lookup(keys) == {"a": 10, "b": 5}
    index.close()


def test_publisher_resync_restores_both_tiers(redis_server: RedisServer) -> None:
    """A worker whose snapshot names both tiers (``TierKeys``, as worker/index_link.py gives it)
    gets its host-tier entries back after Redis lost everything."""
    from kvstore.publisher import WorkerPublisher
    from kvstore.types import WorkerLoad

    cfg = IndexConfig(
        url=redis_server.url,
        model_id="pub-host",
        heartbeat_ttl_s=1.0,
        socket_timeout_s=0.2,
        connect_timeout_s=0.2,
    )
    index = KVIndex(cfg)
    kv = KVCacheManager(4, 2, host_num_blocks=8)
    snapshot = lambda: TierKeys(kv.cached_keys(), kv.host_cached_keys())  # noqa: E731
    pub = WorkerPublisher(index, "w", snapshot, max_backoff_s=0.1, purge_interval_s=None)
    load = WorkerLoad(0, 0, 4, 4, 0)
    pub.start()
    try:
        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        kv.allocate_slots("a", prompt, 8, ctx=CTX)
        kv.free("a")
        kv.allocate_slots("b", [9, 10, 11, 12, 13, 14, 15, 16], 8, ctx=CTX)  # a -> host
        kv.take_transfers()
        pub.submit(kv.drain_events(), load)
        assert pub.flush()
        keys = block_keys(prompt, 2, CTX)
        assert index.lookup_tiers(keys) == {"w": (0, 4)}
        redis_server.stop()
        redis_server.start()  # same port, empty
        pub.request_resync()
        deadline = time.monotonic() + 10
        while index.lookup_tiers(keys) != {"w": (0, 4)}:
            assert time.monotonic() < deadline, index.lookup_tiers(keys)
            time.sleep(0.05)
        assert index.held_keys("w", host=True) == set(kv.host_cached_keys())
    finally:
        pub.stop()
        index.close()
