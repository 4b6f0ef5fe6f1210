"""KVIndex against a real redis-server: apply, lookup, eviction, epochs, purge, resync.

Tests that take the ``index`` fixture run with both lookup modes (``bisect`` and ``scan``);
their indices are prefix-closed, as a KV manager publishes them, so both must agree. Tests
with a hand-made hole pick ``scan`` (or show where ``bisect`` differs).
"""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.blocks.events import AllBlocksCleared
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from kvstore.index_types import WorkerLoad
from tests.kvstore.helpers import chain, removed, stored, tiers
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

LOAD = WorkerLoad(running=2, waiting=1, free_blocks=10, total_blocks=64, queued_prefill_tokens=96)


def make_index(server: RedisServer, **kw: object) -> KVIndex:
    return KVIndex(IndexConfig(url=server.url, model_id="tiny-llama", **kw))


def held(index: KVIndex, worker_id: str) -> set[bytes]:
    return index.held_keys(worker_id)


def blk_slots(index: KVIndex) -> dict[bytes, bytes]:
    return index.client.hgetall(index.config.namespace + "blk:device")


@pytest.fixture(params=["bisect", "scan"])
def index(redis_server: RedisServer, request: pytest.FixtureRequest) -> KVIndex:
    idx = make_index(redis_server, lookup=request.param)
    yield idx
    idx.close()


def test_apply_then_lookup_counts_leading_blocks_per_worker(index: KVIndex) -> None:
    keys = chain(10)
    ea, eb = index.register("a"), index.register("b")
    index.register("idle")
    assert index.apply_events("a", ea, 1, [stored(keys[:4]), stored(keys[4:], keys[3])]).added == 10
    assert index.apply_events("b", eb, 1, [stored(keys[:6])]).added == 6
    assert index.lookup(keys) == {"a": 10, "b": 6, "idle": 0}
    assert index.lookup(keys[:3]) == {"a": 3, "b": 3, "idle": 0}
    assert index.lookup(chain(5, salt=9)) == {"a": 0, "b": 0, "idle": 0}
    assert index.lookup([]) == {"a": 0, "b": 0, "idle": 0}
    # a prompt that diverges after block 5 shares only the common prefix
    other = keys[:5] + chain(3, salt=7)
    assert index.lookup(other)["a"] == 5


def test_hole_stops_scan_count_and_eviction_updates(redis_server: RedisServer) -> None:
    index = make_index(redis_server, lookup="scan")
    keys = chain(8)
    e = index.register("a")
    index.apply_events("a", e, 1, [stored(keys)])
    result = index.apply_events("a", e, 2, [removed(keys[3], keys[6])])
    assert (result.applied, result.removed) == (True, 2)
    assert index.lookup(keys) == {"a": 3}
    assert index.lookup(keys[4:]) == {"a": 2}  # the blocks after the hole are still held
    index.apply_events("a", e, 3, [stored([keys[3]], keys[2])])
    assert index.lookup(keys) == {"a": 6}
    # removing a key never stored is a no-op
    assert index.apply_events("a", e, 4, [removed(*chain(2, salt=5))]).removed == 0
    index.close()


def test_bisect_trusts_prefix_closure_where_scan_sees_the_hole(redis_server: RedisServer) -> None:
    """A hand-made index that no KV manager publishes, with holes: of an 8-block prompt "a"
    holds every block but 5, "b" holds 0-2 and 4. Scan reads every key and stops at each
    hole. Bisect probes keys 1, 2, 4 (held by both), 7 (only "a"), then 5 (neither): it never
    reads key 3, so it credits "b" with 5 blocks; alone, "a" is probed at 1, 2, 4, 7 only and
    credited with all 8. Exact only for prefix-closed indices, and a bisect that silently
    scanned would fail here.
    """
    keys = chain(8)
    scan, bisect = (make_index(redis_server, lookup=m) for m in ("scan", "bisect"))
    ea, eb = scan.register("a"), scan.register("b")
    scan.apply_events("a", ea, 1, [stored(keys), removed(keys[5])])
    scan.apply_events("b", eb, 1, [stored(keys[:3]), stored([keys[4]], keys[3])])
    assert scan.lookup(keys) == {"a": 5, "b": 3}
    assert bisect.lookup(keys) == {"a": 5, "b": 5}
    scan.deregister("b", eb)
    assert scan.lookup(keys) == {"a": 5}
    assert bisect.lookup(keys) == {"a": 8}
    # on a prefix that avoids the holes both agree
    assert scan.lookup(keys[:5]) == bisect.lookup(keys[:5]) == {"a": 5}
    scan.close()
    bisect.close()


def test_all_cleared_forgets_only_that_worker(index: KVIndex) -> None:
    keys = chain(6)
    ea, eb = index.register("a"), index.register("b")
    index.apply_events("a", ea, 1, [stored(keys)])
    index.apply_events("b", eb, 1, [stored(keys[:2])])
    result = index.apply_events("a", ea, 2, [AllBlocksCleared(5), stored(keys[:1])])
    assert (result.removed, result.added) == (6, 1)
    assert index.lookup(keys) == {"a": 1, "b": 2}
    assert held(index, "a") == {keys[0]}
    assert len(blk_slots(index)) == 2


def test_restart_supersedes_old_epoch_at_once_and_purge_frees_it(index: KVIndex) -> None:
    keys = chain(5)
    e1 = index.register("a")
    index.apply_events("a", e1, 1, [stored(keys)])
    e2 = index.register("a")
    assert e2 > e1
    assert index.lookup(keys) == {"a": 0}  # old entries ignored without any purge
    stale = index.apply_events("a", e1, 2, [stored(keys)])
    assert (stale.applied, stale.needs_resync, stale.stale_epoch) == (False, True, True)
    assert not index.heartbeat("a", e1, LOAD)
    assert len(blk_slots(index)) == 5  # still stored ...
    assert index.purge_dead() == 1
    assert blk_slots(index) == {}  # ... until purged
    assert index.purge_dead() == 0
    index.apply_events("a", e2, 1, [stored(keys[:2])])
    assert index.lookup(keys) == {"a": 2}
    assert index.live_workers()["a"].epoch == e2


def test_dead_worker_is_ignored_when_heartbeat_expires_then_purged(
    redis_server: RedisServer,
) -> None:
    index = make_index(redis_server, heartbeat_ttl_s=0.3)
    keys = chain(4)
    ea, eb = index.register("a", address="10.0.0.1:5000"), index.register("b")
    index.apply_events("a", ea, 1, [stored(keys)])
    index.apply_events("b", eb, 1, [stored(keys[:1])])
    assert index.heartbeat("a", ea, LOAD)
    live = index.live_workers()
    assert live["a"].load == LOAD and live["a"].address == "10.0.0.1:5000"
    assert live["b"].load == WorkerLoad(0, 0, 0, 0, 0) and live["b"].address is None
    deadline = time.monotonic() + 5
    while "b" in index.lookup(keys) and time.monotonic() < deadline:  # b never heartbeats
        assert index.heartbeat("a", ea, LOAD)
        time.sleep(0.05)
    assert index.lookup(keys) == {"a": 4}
    assert set(index.live_workers()) == {"a"}
    assert index.purge_dead() == 1
    assert set(blk_slots(index).values()) == {b"\x00\x00"}  # only a's slot (0) remains
    assert not index.heartbeat("b", eb, LOAD)  # purged: b must register again
    assert index.apply_events("b", eb, 2, []).stale_epoch
    eb2 = index.register("b")
    assert index.resync("b", eb2, 1, keys[:3])
    assert index.lookup(keys) == {"a": 4, "b": 3}
    index.close()


def test_sequence_gap_needs_resync_and_resync_replaces_the_set(index: KVIndex) -> None:
    keys = chain(6)
    e = index.register("a")
    assert index.apply_events("a", e, 1, [stored(keys[:3])]).applied
    dup = index.apply_events("a", e, 1, [stored(keys[:3])])
    assert (dup.applied, dup.duplicate, dup.needs_resync) == (False, True, False)
    gap = index.apply_events("a", e, 3, [stored(keys[3:], keys[2])])
    assert (gap.applied, gap.needs_resync, gap.stale_epoch) == (False, True, False)
    assert index.lookup(keys) == {"a": 3}  # the batch after the gap changed nothing
    assert index.apply_events("a", e, 4, []).needs_resync  # still behind until resync
    assert index.resync("a", e, 3, keys[1:])  # the pool now holds blocks 1..5
    assert held(index, "a") == set(keys[1:])
    assert index.lookup(keys) == {"a": 0}
    assert index.lookup(keys[1:]) == {"a": 5}
    assert index.apply_events("a", e, 4, [removed(keys[5])]).applied
    assert index.lookup(keys[1:]) == {"a": 4}
    assert not index.resync("a", e - 1, 9, keys)  # stale epoch


def test_deregister_hides_worker_and_purge_reuses_the_slot(index: KVIndex) -> None:
    keys = chain(3)
    e = index.register("a")
    index.apply_events("a", e, 1, [stored(keys)])
    index.deregister("a", e)
    assert index.lookup(keys) == {}
    assert index.live_workers() == {}
    assert index.purge_dead() == 1
    assert blk_slots(index) == {}
    eb = index.register("b")  # gets the freed slot 0 without inheriting anything
    assert index.client.hget(index.config.namespace + "reg", "b") == f"0:{eb}".encode()
    assert index.lookup(keys) == {"b": 0}


def test_record_every_k_is_exact_at_multiples_of_k(redis_server: RedisServer) -> None:
    index = make_index(redis_server, record_every=4)
    keys = chain(11)
    e = index.register("a")
    # blocks 0..5, then 6..10 in a second event chained through its parent
    index.apply_events("a", e, 1, [stored(keys[:6]), stored(keys[6:], keys[5])])
    assert held(index, "a") == {keys[3], keys[7]}  # positions 3 and 7 only
    assert index.lookup(keys) == {"a": 8}
    assert index.lookup(keys[:7]) == {"a": 4}
    index.apply_events("a", e, 2, [removed(keys[5])])  # not recorded: invisible
    assert index.lookup(keys) == {"a": 8}
    index.apply_events("a", e, 3, [removed(keys[7])])
    assert index.lookup(keys) == {"a": 4}
    # a chain whose parent the index never saw is not recorded (never over-counts)
    orphan = chain(8, salt=3)
    index.apply_events("a", e, 4, [stored(orphan[4:], orphan[3])])
    assert index.lookup(orphan) == {"a": 0}
    # resync keeps the cached keys at recorded positions it knows
    pool = [k for k in keys if k not in (keys[5], keys[7])] + orphan
    assert index.resync("a", e, 5, pool)
    assert held(index, "a") == {keys[3]}
    assert index.lookup(keys) == {"a": 4}
    index.close()


def test_concurrent_writers_and_readers(index: KVIndex) -> None:
    workers = [f"w{i}" for i in range(6)]
    chains = {w: chain(40, salt=i) for i, w in enumerate(workers)}
    shared = chain(20, salt=99)
    epochs = {w: index.register(w) for w in workers}
    errors: list[BaseException] = []

    def write(w: str) -> None:
        try:
            seq = 0
            for start in range(0, 40, 5):
                seq += 1
                parent = chains[w][start - 1] if start else None
                events = [stored(chains[w][start : start + 5], parent)]
                if start == 0:
                    events.append(stored(shared))
                assert index.apply_events(w, epochs[w], seq, events).applied
            seq += 1  # evict the tail, children first (as the pool's LRU does)
            index.apply_events(w, epochs[w], seq, [removed(*reversed(chains[w][30:]))])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def read() -> None:
        try:
            for _ in range(30):
                counts = index.lookup(shared)
                assert set(counts) == set(workers)
                assert all(c in (0, 20) for c in counts.values())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in workers]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert index.lookup(shared) == dict.fromkeys(workers, 20)
    for w in workers:
        assert index.lookup(chains[w]) == {**dict.fromkeys(workers, 0), w: 30}
        assert len(held(index, w)) == 30 + 20
    assert len(blk_slots(index)) == 6 * 30 + 20
    assert set(blk_slots(index)[shared[0]]) == set(range(6))  # one holder byte pair each


def test_blk_values_are_sorted_slot_lists(index: KVIndex) -> None:
    keys = chain(2)
    epochs = {w: index.register(w) for w in ("a", "b", "c")}
    for w in ("c", "a", "b"):  # stored in another order than the slots
        index.apply_events(w, epochs[w], 1, [stored(keys)])
    assert blk_slots(index)[keys[0]] == b"\x00\x00\x00\x01\x00\x02"
    index.apply_events("b", epochs["b"], 2, [removed(keys[0])])
    assert blk_slots(index)[keys[0]] == b"\x00\x00\x00\x02"
    assert index.lookup(keys) == {"a": 2, "b": 0, "c": 2}


def test_bad_keys_and_names_are_rejected(index: KVIndex) -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        index.lookup([b"short"])
    with pytest.raises(ValueError, match="worker id"):
        index.register("a\nb")
    with pytest.raises(TypeError, match="not a KV event"):
        index.apply_events("a", index.register("a"), 1, [object()])


def test_purge_works_in_bounded_chunks_and_spares_live_workers(index: KVIndex) -> None:
    keys = chain(25)
    ea, eb = index.register("a"), index.register("b")
    index.apply_events("a", ea, 1, [stored(keys)])
    index.apply_events("b", eb, 1, [stored(keys[:10])])
    index.register("a")  # supersedes a's 25 entries
    assert index.purge_dead(chunk=4) == 1  # 7 script calls of at most 4 entries
    assert index.held_keys("b") == set(keys[:10])
    assert set(blk_slots(index)) == set(keys[:10])
    assert index.lookup(keys) == {"a": 0, "b": 10}


def test_lookup_many_answers_as_each_lookup_would_in_one_round_trip(index: KVIndex) -> None:
    """A burst's lookups pipelined: each answer equals its own call's (device-only or per
    tier, as asked), in order, and a Redis that forgot its scripts (SCRIPT FLUSH) is served
    by reloading them."""
    keys = chain(10)
    ea, eb = index.register("a"), index.register("b")
    index.apply_events("a", ea, 1, [stored(keys[:4]), stored(keys[4:], keys[3])])
    index.apply_events("b", eb, 1, [stored(keys[:6])])
    prompts = [(keys, False), (keys[:3], True), (chain(5, salt=9), False), (keys[:7], True)]
    expected = [index.lookup_tiers(k) if t else index.lookup(k) for k, t in prompts]
    assert expected[0] == {"a": 10, "b": 6} and expected[1] == {"a": tiers(3), "b": tiers(3)}
    assert index.lookup_many(prompts) == expected
    assert index.lookup_many(prompts[:1]) == expected[:1]
    index.client.script_flush()
    assert index.lookup_many(prompts) == expected
