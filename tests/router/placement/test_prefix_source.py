"""The in-memory prefix index (fed real KV events) and the pending-placement cache."""

from __future__ import annotations

from router import InMemoryPrefixIndex, PendingPlacements
from router.placement.prefix_source import leading_counts
from tests.router.harness import tokens
from worker.kv import AllBlocksCleared, BlockKey, KVCacheManager, block_keys


def k(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16)


def test_leading_counts_stop_at_each_workers_first_miss() -> None:
    holders = {k(0): {"a", "b", "c"}, k(1): {"a", "b"}, k(2): {"a"}, k(3): {"a", "c"}}
    counts = leading_counts([k(0), k(1), k(2), k(3), k(4)], holders.get)
    assert counts == {"a": 4, "b": 2, "c": 1}
    assert leading_counts([k(9), k(0)], holders.get) == {}


def test_index_follows_a_real_kv_managers_events_including_eviction() -> None:
    index = InMemoryPrefixIndex()
    assert index.lookup([k(0)]) is None  # no events yet: "knows nothing"
    kv = KVCacheManager(8, 16)  # 8 blocks: a second 96-token prompt evicts the first
    first, second = tokens(1, 96), tokens(2, 96)
    kv.allocate_slots("a", first, 96)
    kv.free("a")
    index.apply("w", kv.drain_events())
    keys = block_keys(first, 16)
    assert index.lookup(keys) == {"w": 6} and index.num_keys("w") == 6
    kv.allocate_slots("b", second, 96)  # needs 6 blocks: evicts 4 of the first (LRU, tail first)
    index.apply("w", kv.drain_events())
    assert index.lookup(keys) == {"w": 2}
    assert index.lookup(block_keys(second, 16)) == {"w": 6}
    assert index.gaps == 0
    index.apply("w", [AllBlocksCleared(seq=99)])  # seq jumps: a lost event is counted
    assert index.gaps == 1 and index.lookup(keys) == {} and index.num_keys("w") == 0


def test_pending_placements_refresh_and_expire() -> None:
    pending = PendingPlacements(ttl_s=2.0)
    pending.record("a", [k(0), k(1)], now=0.0)
    pending.record("b", [k(0)], now=1.0)
    assert pending.lookup([k(0), k(1)], now=1.5) == {"a": 2, "b": 1}
    pending.record("a", [k(0)], now=1.9)  # refreshes a's k(0) only
    assert pending.lookup([k(0), k(1)], now=2.5) == {"a": 1, "b": 1}
    assert pending.lookup([k(0)], now=3.85) == {"a": 1}
    assert pending.lookup([k(0)], now=3.9) == {} and len(pending) == 0
