"""WorkerPublisher: background batching, heartbeats, outages and resync against real Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvstore.blocks.hashing import BlockKey
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from kvstore.index_types import WorkerLoad
from kvstore.publisher import WorkerPublisher
from tests.kvstore.helpers import Pool, chain
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

LOAD = WorkerLoad(running=1, waiting=0, free_blocks=50, total_blocks=64, queued_prefill_tokens=0)


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def held(index: KVIndex, worker_id: str) -> set[bytes]:
    return index.held_keys(worker_id)


@pytest.fixture
def index(redis_server: RedisServer) -> Iterator[KVIndex]:
    idx = KVIndex(
        IndexConfig(
            url=redis_server.url,
            model_id="m",
            heartbeat_ttl_s=1.0,
            socket_timeout_s=0.2,
            connect_timeout_s=0.2,
        )
    )
    yield idx
    idx.close()


@pytest.fixture
def pool() -> Pool:
    return Pool()


@pytest.fixture
def publisher(index: KVIndex, pool: Pool) -> Iterator[WorkerPublisher]:
    pub = WorkerPublisher(
        index,
        "w",
        pool.list_cached_keys,
        address="host:1",
        max_backoff_s=0.1,
        purge_interval_s=None,
    )
    pub.start()
    yield pub
    pub.stop()


def test_events_and_load_reach_the_index(
    index: KVIndex, pool: Pool, publisher: WorkerPublisher
) -> None:
    keys = chain(12)
    publisher.submit(pool.store(keys[:8]), LOAD)
    # evictions drop children before parents, as the KV manager's LRU does
    publisher.submit(pool.store(keys[8:], keys[7]) + pool.evict(keys[11], keys[10]), LOAD)
    assert publisher.flush()
    assert index.lookup(keys) == {"w": 10}
    info = index.live_workers()["w"]
    assert (info.epoch, info.address, info.load) == (publisher.epoch, "host:1", LOAD)
    stats = publisher.stats
    assert (stats.events_submitted, stats.events_applied, stats.events_dropped) == (3, 3, 0)
    assert (stats.registrations, stats.resyncs) == (1, 1)
    busier = WorkerLoad(4, 2, 10, 64, 512)
    publisher.submit([], busier)  # load alone is published soon after it changes
    wait_for(lambda: index.live_workers()["w"].load == busier)


def test_stop_deregisters(index: KVIndex, pool: Pool, publisher: WorkerPublisher) -> None:
    publisher.submit(pool.store(chain(2)), LOAD)
    assert publisher.flush()
    publisher.stop()
    assert index.lookup(chain(2)) == {}
    assert index.purge_dead() == 1


def test_redis_restart_mid_run_is_recovered_by_resync(
    redis_server: RedisServer, index: KVIndex, pool: Pool, publisher: WorkerPublisher
) -> None:
    keys = chain(30)
    publisher.submit(pool.store(keys[:10]), LOAD)
    assert publisher.flush()
    first_epoch = publisher.epoch
    redis_server.stop()
    publisher.submit(pool.store(keys[10:20], keys[9]), LOAD)  # never blocks on Redis
    publisher.submit(pool.evict(*reversed(keys[15:20])), LOAD)
    wait_for(lambda: not publisher.healthy)
    redis_server.start()  # same port, empty: registration and entries are gone
    assert publisher.flush(timeout_s=10)
    assert index.lookup(keys) == {"w": 15}
    assert held(index, "w") == set(pool.list_cached_keys())
    assert publisher.epoch > first_epoch
    stats = publisher.stats
    assert stats.registrations == 2 and stats.resyncs == 2 and stats.errors >= 1


def test_restart_with_record_every_keeps_positions(redis_server: RedisServer, pool: Pool) -> None:
    index = KVIndex(
        IndexConfig(
            url=redis_server.url,
            model_id="m",
            record_every=2,
            heartbeat_ttl_s=1.0,
            socket_timeout_s=0.2,
        )
    )
    pub = WorkerPublisher(
        index, "w", pool.list_cached_keys, max_backoff_s=0.1, purge_interval_s=None
    )
    pub.start()
    keys = chain(9)
    pub.submit(pool.store(keys[:5]) + pool.store(keys[5:], keys[4]), LOAD)
    assert pub.flush()
    assert index.lookup(keys) == {"w": 8}
    redis_server.restart()  # empty again: the resync must still know which keys to record
    wait_for(lambda: pub.stats.registrations == 2)
    assert pub.flush()
    assert index.held_keys("w") == {keys[1], keys[3], keys[5], keys[7]}
    assert index.lookup(keys) == {"w": 8}
    pub.stop()
    index.close()


def test_buffer_overflow_drops_events_then_resyncs(
    redis_server: RedisServer, index: KVIndex, pool: Pool
) -> None:
    pub = WorkerPublisher(
        index,
        "w",
        pool.list_cached_keys,
        max_buffer_events=4,
        max_backoff_s=0.1,
        purge_interval_s=None,
    )
    pub.start()
    keys = chain(20)
    pub.submit(pool.store(keys[:2]), LOAD)
    assert pub.flush()
    redis_server.stop()
    wait_for(lambda: not pub.healthy)
    for i in range(2, 20):
        pub.submit(pool.store([keys[i]], keys[i - 1]), LOAD)
    assert pub.stats.events_dropped > 0
    redis_server.start()
    assert pub.flush(timeout_s=10)
    assert index.lookup(keys) == {"w": 20}
    pub.stop()


def test_sequence_gap_triggers_resync(
    index: KVIndex, pool: Pool, publisher: WorkerPublisher
) -> None:
    keys = chain(6)
    publisher.submit(pool.store(keys[:3]), LOAD)
    assert publisher.flush()
    resyncs = publisher.stats.resyncs
    slot = index.client.hget(index.config.namespace + "reg", "w").split(b":")[0]
    index.client.hset(index.config.namespace + "seq", slot, 0)  # the server "lost" batches
    index.client.srem(index.config.namespace + "held:device:" + slot.decode(), keys[0])  # and lost
    index.client.hdel(index.config.namespace + "blk:device", keys[0])  # an entry (consistently)
    publisher.submit(pool.store(keys[3:], keys[2]), LOAD)
    assert publisher.flush()
    assert publisher.stats.resyncs == resyncs + 1
    assert held(index, "w") == set(keys)
    assert index.lookup(keys) == {"w": 6}


def test_purged_worker_registers_again_and_resyncs(
    index: KVIndex, pool: Pool, publisher: WorkerPublisher
) -> None:
    keys = chain(4)
    publisher.submit(pool.store(keys), LOAD)
    assert publisher.flush()
    first_epoch = publisher.epoch
    slot = index.client.hget(index.config.namespace + "reg", "w").split(b":")[0].decode()
    index.client.delete(index.config.namespace + "hb:" + slot)  # as if the TTL had expired
    assert index.lookup(keys) == {}
    assert index.purge_dead() == 1
    wait_for(lambda: index.lookup(keys) == {"w": 4})  # the next heartbeat notices
    assert publisher.epoch > first_epoch
    assert publisher.stats.registrations == 2


def test_lost_events_make_the_recorder_start_afresh(redis_server: RedisServer, pool: Pool) -> None:
    """``submit`` overflowing loses events before the recorder sees them: with k > 1 the
    recorder forgets its positions, so the index stays prefix-closed (it under-counts the
    blocks cached before the loss) and records new chains again at once."""
    index = KVIndex(IndexConfig(url=redis_server.url, model_id="m", record_every=2))
    keys, other = chain(8), chain(4, salt=1)
    first = WorkerPublisher(index, "w", pool.list_cached_keys, purge_interval_s=None)
    first.start()
    first.submit(pool.store(keys), LOAD)
    assert first.flush() and index.held_keys("w") == {keys[1], keys[3], keys[5], keys[7]}
    first.stop(deregister=False)
    # A second publisher of the same worker shares its recorder (and its positions); its
    # thread is not running yet, so its one-event inbox overflows.
    pub = WorkerPublisher(
        index, "w", pool.list_cached_keys, max_buffer_events=1, purge_interval_s=None
    )
    pub.submit(pool.evict(*reversed(keys[4:])), LOAD)
    pub.submit(pool.store(keys[4:], keys[3]), LOAD)  # lost
    assert pub.stats.events_dropped == 1
    pub.start()
    assert pub.flush()
    assert pub.stats.events_dropped == 2 and pub.stats.resyncs == 1
    assert index.held_keys("w") == set() and index.lookup(keys) == {"w": 0}
    pub.submit(pool.store(other), LOAD)
    assert pub.flush()
    assert index.held_keys("w") == {other[1], other[3]} and index.lookup(other) == {"w": 4}
    pub.stop()
    index.close()


@pytest.mark.parametrize("marked", [True, False])
def test_a_marked_resync_snapshot_is_not_overwritten_by_older_events(
    index: KVIndex, pool: Pool, marked: bool
) -> None:
    """Step 1 evicts C and its parent P, step 2 stores P again with another child D; the
    resync snapshot is taken after both. Replaying step 1 on it would leave D without P (a
    hole) until step 2 arrives; with the snapshot marked, both steps are superseded instead.
    The thread is not started: drain and sync run here, in the order the thread runs them."""
    k0, p, c, d = chain(3) + [chain(1, salt=7)[0]]
    cut_taken = []

    def snapshot() -> list[BlockKey]:
        if marked:
            pub.mark_snapshot()
            cut_taken.append(True)
        return pool.list_cached_keys()

    pub = WorkerPublisher(index, "w", snapshot, purge_interval_s=None)
    pub.submit(pool.store([k0, p, c]), LOAD)
    pub.sync.drain()
    pub.sync.sync(time.monotonic())  # registered; [k0, p, c] published
    assert index.lookup([k0, p, c]) == {"w": 3}
    pub.submit(pool.evict(c, p), LOAD)  # step 1
    pub.sync.drain()  # into the outbox (not sent yet: Redis is slow, say)
    pub.submit(pool.store([p], k0) + pool.store([d], p), LOAD)  # step 2, still in the inbox
    pub.sync.want_resync()
    pub.sync.sync(time.monotonic())  # resync, then whatever is left in the outbox
    after = index.held_keys("w")
    if marked:
        assert cut_taken and after == {k0, p, d}  # the snapshot, exactly
        assert pub.stats.events_applied == pub.stats.events_submitted  # nothing lost
    else:
        assert after == {k0, d}  # the hole: d without its parent p
    pub.sync.drain()
    pub.sync.sync(time.monotonic())
    assert index.held_keys("w") == {k0, p, d}  # either way it converges
    assert index.lookup([k0, p, d]) == {"w": 3}
    pub.stop()
