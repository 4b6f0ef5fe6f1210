"""The free queue and the pool in isolation: exact orders, O(1) removal, lazy eviction."""

from __future__ import annotations

import pytest

from kvstore.blocks.events import BlockRemoved, BlockStored
from kvstore.blocks.hashing import BlockKey
from worker.kv.block_pool import BlockPool, BlockPoolError, FreeBlockQueue, KVBlock


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_push_pop_remove_exact_order() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert _ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])  # middle
    q.remove(blocks[0])  # front
    q.remove(blocks[4])  # back
    assert _ids(q) == [1, 3] and len(q) == 2
    assert blocks[2].prev is None and blocks[2].next is None
    q.appendleft(blocks[4])
    q.append(blocks[0])
    assert _ids(q) == [4, 1, 3, 0]
    assert [q.popleft().block_id for _ in range(4)] == [4, 1, 3, 0]
    assert len(q) == 0 and _ids(q) == []


def test_free_queue_rejects_double_insert_and_foreign_remove() -> None:
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks[:1])
    with pytest.raises(BlockPoolError, match="already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(BlockPoolError, match="not in the free queue"):
        q.remove(blocks[1])
    q.popleft()
    with pytest.raises(BlockPoolError, match="empty"):
        q.popleft()


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16)


def test_pool_release_order_and_lazy_eviction() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a = pool.take_new(3)
    assert [b.block_id for b in a] == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    pool.cache_full_blocks(a[:2], [_key(1), _key(2)], [(1, 1), (2, 2)], None)
    # Tail-first release: uncached block 2 goes to the front, cached 1 then 0 to the back.
    pool.release(reversed(a))
    assert _ids(pool.free_queue) == [2, 3, 1, 0]
    assert pool.num_evictable == 2 and set(pool.cached) == {_key(1), _key(2)}
    # Keys survive until the block is handed out again (lazy eviction).
    taken = pool.take_new(3)
    assert [b.block_id for b in taken] == [2, 3, 1]
    assert set(pool.cached) == {_key(1)} and taken[2].key is None
    events = pool.events.drain()
    assert events == [
        BlockStored(0, (_key(1), _key(2)), None, ((1, 1), (2, 2)), 2),
        BlockRemoved(1, (_key(2),)),
    ]


def test_pool_touch_takes_evictable_block_out_of_the_middle() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    blocks = pool.take_new(3)
    pool.cache_full_blocks(blocks, [_key(0), _key(1), _key(2)], [(0,), (1,), (2,)], None)
    pool.release(blocks)
    assert _ids(pool.free_queue) == [0, 1, 2]
    hit = pool.lookup(_key(1), (1,))
    assert hit is blocks[1]
    assert pool.lookup(_key(1), (7,)) is None  # same key, other tokens: a collision never hits
    pool.touch([hit])
    assert _ids(pool.free_queue) == [0, 2] and hit.ref_cnt == 1 and pool.num_evictable == 2


def test_pool_duplicate_key_stays_uncached_and_splits_the_event_run() -> None:
    pool = BlockPool(num_blocks=4, block_size=1)
    first = pool.take_new(1)
    pool.cache_full_blocks(first, [_key(1)], [(1,)], None)
    chain = pool.take_new(3)
    pool.cache_full_blocks(chain, [_key(0), _key(1), _key(2)], [(0,), (1,), (2,)], None)
    assert chain[1].key is None and pool.cached[_key(1)] is first[0]
    assert pool.twins == {_key(1): [chain[1]]} and chain[1].twin_of == _key(1)
    assert pool.events.drain() == [
        BlockStored(0, (_key(1),), None, ((1,),), 1),
        BlockStored(1, (_key(0),), None, ((0,),), 1),
        BlockStored(2, (_key(2),), _key(1), ((2,),), 1),
    ]


def test_twin_release_and_promotion_on_the_bare_pool() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    served, twin, other = pool.take_new(3)
    pool.cache_full_blocks([served], [_key(1)], [(1,)], None)
    pool.cache_full_blocks([twin], [_key(1)], [(1,)], None)
    pool.release([served, other])  # served evictable at the back, other (uncached) in front
    assert _ids(pool.free_queue) == [2, 0]
    pool.touch([twin])  # a fork: two refs on the twin
    pool.release([twin])
    assert pool.twins == {_key(1): [twin]}  # still in use: still a twin
    assert [b.block_id for b in pool.take_new(2)] == [2, 0]
    assert pool.cached == {_key(1): twin} and twin.key == _key(1) and twin.twin_of is None
    assert pool.twins == {}
    assert pool.events.drain() == [BlockStored(0, (_key(1),), None, ((1,),), 1)]


def test_check_prefix_closed_names_the_hole() -> None:
    from worker.kv.invariants import check_prefix_closed, record_parents

    parents: dict = {}
    chain = (_key(0), _key(1), _key(2))
    record_parents(BlockStored(0, chain, None, ((0,), (1,), (2,)), 1), parents)
    record_parents(BlockRemoved(1, (_key(2),)), parents)  # names no parent
    assert parents == {_key(0): None, _key(1): _key(0), _key(2): _key(1)}
    check_prefix_closed({_key(0), _key(1)}, parents)
    check_prefix_closed(set(), parents)
    with pytest.raises(AssertionError, match="uncached parent"):
        check_prefix_closed({_key(0), _key(2)}, parents)
    with pytest.raises(AssertionError, match="never announced"):
        check_prefix_closed({_key(9)}, parents)


def test_pool_reset_refused_while_in_use() -> None:
    pool = BlockPool(num_blocks=2, block_size=1)
    blocks = pool.take_new(1)
    pool.cache_full_blocks(blocks, [_key(5)], [(5,)], None)
    pool.events.drain()
    assert pool.reset_cache() is False
    assert set(pool.cached) == {_key(5)} and len(pool.events) == 0
    pool.release(blocks)
    assert pool.reset_cache() is True
    assert pool.cached == {} and blocks[0].key is None and pool.num_evictable == 0


def test_check_invariants_detects_corruption() -> None:
    from worker.kv import HashContext, KVCacheManager

    kv = KVCacheManager(4, 2)
    kv.allocate_slots("a", [1, 2, 3], 3, ctx=HashContext())
    kv.free("a")
    kv.allocate_slots(
        "b", [1, 2, 3], 1, ctx=HashContext(), prefix=kv.lookup_prefix([1, 2, 3], HashContext())
    )
    kv.check_invariants()
    pool = kv.pool
    pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_invariants()
    pool.blocks[0].ref_cnt -= 1
    pool.num_evictable += 1
    with pytest.raises(AssertionError, match="evictable counter"):
        kv.check_invariants()
    pool.num_evictable -= 1
    pool.free_queue.append(pool.blocks[0])  # an in-use block in the free queue
    with pytest.raises(AssertionError, match="linked into the free queue"):
        kv.check_invariants()
    pool.free_queue.remove(pool.blocks[0])
    kv.check_invariants()
    pool.blocks[1].twin_of = pool.blocks[0].key  # a twin the pool does not list
    with pytest.raises(AssertionError, match="twin"):
        kv.check_invariants()
