"""Exact scenarios of the host tier: eviction order, capacity, load back, tenants, reset."""

from __future__ import annotations

from worker.kv import BlockRemoved, BlockStored, HashContext, KVCacheManager, block_keys

CTX = HashContext("m")
A = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 blocks of 2
B = [9, 10, 11, 12, 13, 14, 15, 16]


def _evict_a(host_blocks: int = 3) -> KVCacheManager:
    kv = KVCacheManager(4, 2, host_num_blocks=host_blocks)
    kv.allocate_slots("a", A, 8, ctx=CTX)
    kv.free("a")
    kv.take_transfers()
    kv.drain_events()
    kv.allocate_slots("b", B, 8, ctx=CTX)  # takes all 4 blocks: evicts A tail-first
    return kv


def test_evicted_blocks_go_to_host_children_first_and_the_oldest_leaves_when_full() -> None:
    kv = _evict_a()
    a = block_keys(A, 2, CTX)
    assert kv.host_cached_keys() == [a[2], a[1], a[0]]  # a[3] came first and left first
    t = kv.take_transfers()
    # (device, host): a[3] (device 3) took host 0, a[2] host 1, a[1] host 2; a[0] (device 0)
    # took host 0 again, so only its copy into host 0 is left to run
    assert sorted(t.to_host) == [(0, 0), (1, 2), (2, 1)]
    assert (t.to_host, t.to_device) and not t.to_device
    host_events = [(type(e).__name__, e.keys) for e in kv.drain_events() if e.tier == "host"]
    assert host_events[-2:] == [("BlockRemoved", (a[3],)), ("BlockStored", (a[0],))]
    kv.check_invariants()


def test_prefix_in_host_loads_back_into_fresh_device_blocks() -> None:
    kv = _evict_a()
    kv.take_transfers()
    kv.free("b")
    kv.drain_events()
    hit = kv.lookup_prefix(A[:7], CTX)
    assert (hit.block_ids, hit.num_tokens, hit.num_host_tokens) == ((), 6, 6)
    alloc = kv.allocate_slots("a2", A[:7], 1, ctx=CTX, prefix=hit)
    assert alloc is not None and (alloc.num_cached_tokens, alloc.num_host_tokens) == (6, 6)
    t = kv.take_transfers()
    table = kv.block_table("a2")
    assert [d for _, d in t.to_device] == table[:3]  # loads fill the first three blocks
    assert kv.host_cached_keys() == []  # moved back, not copied
    events = kv.drain_events()
    stored = [e for e in events if isinstance(e, BlockStored) and e.tier == "device"]
    assert [e.keys for e in stored] == [tuple(block_keys(A, 2, CTX)[:3])]
    assert any(isinstance(e, BlockRemoved) and e.tier == "host" for e in events)
    assert kv.stats().host_hit_tokens == 6
    kv.check_invariants()


def test_other_tenants_never_hit_the_host_tier() -> None:
    kv = _evict_a()
    hit = kv.lookup_prefix(A + [0], HashContext("m", cache_salt="other"))
    assert hit.num_tokens == 0


def test_recompute_preemption_drops_instead_of_offloading() -> None:
    kv = KVCacheManager(4, 2, host_num_blocks=8)
    kv.allocate_slots("a", A, 8, ctx=CTX)
    kv.free("a", offload=False)
    kv.allocate_slots("b", B, 8, ctx=CTX)
    assert kv.host_cached_keys() == [] and not kv.take_transfers()


def test_reset_clears_both_tiers() -> None:
    kv = _evict_a()
    kv.free("b")
    assert kv.reset_prefix_cache()
    assert kv.cached_keys() == [] and kv.host_cached_keys() == []
    kv.check_invariants()
