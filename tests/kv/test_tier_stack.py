"""A third tier is one backend and a registration: device -> host -> the test tier and back.

``tests/kv/mem_tier.py`` registers ``"test-mem"`` (events carry ``Tier.DISK``); the manager
stacks it below the host tier by name, with no code of its own for it.
"""

from __future__ import annotations

import pytest

import tests.kv.mem_tier  # noqa: F401  (registers the "test-mem" tier backend)
from kvstore.blocks.tiers import Tier
from worker.kv import (
    BlockRemoved,
    BlockStored,
    HashContext,
    KVCacheManager,
    TierSpec,
    block_keys,
)

CTX = HashContext("m")
A = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 blocks of 2
B = [9, 10, 11, 12, 13, 14, 15, 16]
D, H, M = Tier.DEVICE, Tier.HOST, Tier.DISK


def _stack(mem_blocks: int = 8, **kw: object) -> KVCacheManager:
    return KVCacheManager(
        4,
        2,
        host_num_blocks=2,
        lower_tiers=[TierSpec("test-mem", mem_blocks, kw)],
    )


def _evict_a(kv: KVCacheManager) -> None:
    kv.allocate_slots("a", A, 8, ctx=CTX)
    kv.free("a")
    kv.take_transfers()
    kv.drain_events()
    kv.allocate_slots("b", B, 8, ctx=CTX)  # takes all 4 blocks: evicts A tail-first


def _events(kv: KVCacheManager) -> list[tuple[str, Tier, tuple[bytes, ...]]]:
    return [(type(e).__name__[5:], e.tier, e.keys) for e in kv.drain_events()]


def test_blocks_flow_device_to_host_to_the_test_tier() -> None:
    kv = _stack()
    _evict_a(kv)
    a, b = block_keys(A, 2, CTX), block_keys(B, 2, CTX)
    assert _events(kv) == [
        ("Stored", H, (a[3],)),
        ("Stored", H, (a[2],)),
        ("Removed", H, (a[3],)),  # the host is full: its oldest goes down a tier
        ("Stored", M, (a[3],)),
        ("Stored", H, (a[1],)),
        ("Removed", H, (a[2],)),
        ("Stored", M, (a[2],)),
        ("Stored", H, (a[0],)),
        ("Removed", D, (a[3], a[2], a[1], a[0])),
        ("Stored", D, tuple(b)),
    ]
    assert kv.host_cached_keys() == [a[1], a[0]]
    assert kv.tier_cached_keys(M) == [a[3], a[2]]
    t = kv.take_transfers()
    # host blocks 0 and 1 were stored twice: the last copy into each runs; what left them
    # for the test tier before its copy ran is copied from the device
    assert t.to_host == [(1, 0), (0, 1)]
    assert t.stores == [(D, 3, M, 0), (D, 2, M, 1)]
    assert not (t.moves or t.to_device or t.loads)
    stats = kv.stats()
    assert (stats.host_stored_blocks, stats.host_evicted_blocks, stats.host_cached_blocks) == (
        4,
        2,
        2,
    )
    assert [(s.tier, s.cached_blocks, s.stored_blocks) for s in stats.tiers] == [
        (H, 2, 4),
        (M, 2, 2),
    ]
    kv.check_invariants()


def test_host_to_test_tier_copies_run_before_the_stores_that_reuse_them() -> None:
    kv = _stack()
    _evict_a(kv)
    kv.take_transfers()  # the copies ran: host blocks hold a[1] and a[0]
    kv.free("b")
    kv.drain_events()
    kv.allocate_slots("c", [20 + i for i in range(8)], 8, ctx=CTX)  # evicts b
    t = kv.take_transfers()
    # b[3], b[2] push a[1], a[0] (written in an earlier step) down from the host first
    assert t.moves == [(H, 0, M, 2), (H, 1, M, 3)]
    assert [h for _, h in t.to_host] == [0, 1]
    kv.check_invariants()


def test_a_prefix_continues_through_every_tier_and_loads_back() -> None:
    kv = _stack()
    _evict_a(kv)
    kv.take_transfers()
    kv.free("b")
    kv.drain_events()
    a = block_keys(A, 2, CTX)
    hit = kv.lookup_prefix(A[:7], CTX)
    assert (hit.block_ids, hit.keys, hit.num_tokens) == ((), tuple(a[:3]), 6)
    assert (hit.num_host_tokens, hit.num_lower_tokens) == (4, 6)
    alloc = kv.allocate_slots("a2", A[:7], 1, ctx=CTX, prefix=hit)
    assert alloc is not None
    assert (alloc.num_cached_tokens, alloc.num_host_tokens, alloc.num_lower_tokens) == (6, 4, 6)
    table = kv.block_table("a2")
    events = _events(kv)
    assert events[:2] == [("Removed", H, (a[0], a[1])), ("Removed", M, (a[2],))]
    assert ("Stored", D, tuple(a[:3])) in events
    t = kv.take_transfers()
    assert t.to_device == [(1, table[0]), (0, table[1])]
    assert t.loads == [(M, 1, D, table[2])]
    assert kv.tier_cached_keys(M) == [a[3]] and kv.host_cached_keys() == []
    hits = {s.tier: s.hit_tokens for s in kv.stats().tiers}
    assert hits == {H: 4, M: 2} and kv.stats().host_hit_tokens == 4
    kv.check_invariants()
    kv.free("a2")
    assert kv.reset_prefix_cache()
    assert kv.cached_keys() == [] and kv.host_cached_keys() == [] and kv.tier_cached_keys(M) == []
    kv.check_invariants()


def test_a_slow_tier_is_left_to_recompute_when_loading_costs_more() -> None:
    kv = KVCacheManager(
        4,
        2,
        host_num_blocks=2,
        lower_tiers=[TierSpec("test-mem", 8, {"load_s_per_block": 1.0})],
        recompute_seconds=lambda n_tokens: 0.1 * n_tokens,
    )
    _evict_a(kv)
    kv.take_transfers()
    kv.free("b")
    hit = kv.lookup_prefix(A[:7], CTX)
    assert (hit.num_tokens, hit.num_host_tokens, hit.num_lower_tokens) == (4, 4, 4)


def test_tiers_are_picked_by_name_and_an_unknown_name_lists_the_valid_ones() -> None:
    assert [s.tier for s in _stack().stats().tiers] == [H, M]
    with pytest.raises(ValueError, match="unknown KV tier backend 'nvme'; valid: ") as err:
        KVCacheManager(4, 2, lower_tiers=[TierSpec("nvme", 4)])
    # every registered backend is listed (others, e.g. the simulator's, may be registered)
    valid = str(err.value).split("valid: ")[1].split(", ")
    assert {"disk", "host", "test-mem"} <= set(valid) and valid == sorted(valid)


def test_no_block_leaks_through_a_long_mixed_run() -> None:
    kv = _stack(mem_blocks=3)
    prompts = [[p * 100 + i for i in range(7)] for p in range(6)]
    for round_ in range(4):
        for p, prompt in enumerate(prompts):
            sid = f"{round_}-{p}"
            hit = kv.lookup_prefix(prompt, CTX)
            n_new = len(prompt) - hit.num_tokens
            alloc = kv.allocate_slots(sid, prompt, n_new, ctx=CTX, prefix=hit)
            assert alloc is not None
            kv.take_transfers()
            kv.free(sid, offload=p % 3 != 0)
            kv.check_invariants()
    events = kv.drain_events()
    assert any(isinstance(e, BlockStored) and e.tier is M for e in events)
    assert any(isinstance(e, BlockRemoved) and e.tier is M for e in events)
    assert kv.stats().used_blocks == 0
    assert all(len(b) <= b.num_blocks for b in kv.tiers.backends)
