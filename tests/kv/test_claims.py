"""Claimed blocks last: cached blocks a waiting request's prompt names are evicted only when
no unclaimed block is left, and move back to their run when their last claim goes."""

from __future__ import annotations

import pytest

from kvstore.blocks.hashing import BlockKey
from worker.kv import HashContext, KVCacheManager
from worker.kv.block_pool import BlockPool, KVBlock
from worker.kv.claims import BlockClaims
from worker.kv.invariants import check_invariants


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16)


def _ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def _chain(pool: BlockPool, first: int, n: int, parent: BlockKey | None = None) -> list[KVBlock]:
    """Cache ``n`` chained blocks keyed first.. under ``parent``, then release them
    tail-first (as a finished sequence does)."""
    blocks = pool.take_new(n)
    keys = [_key(first + i) for i in range(n)]
    pool.cache_full_blocks(blocks, keys, [(first + i,) * 2 for i in range(n)], parent)
    pool.release(reversed(blocks))
    return blocks


def _check(pool: BlockPool) -> None:
    check_invariants(pool, {}, caching=True)


def test_claimed_blocks_are_evicted_after_every_unclaimed_one() -> None:
    pool = BlockPool(num_blocks=6, block_size=2)
    a = _chain(pool, 10, 2)  # prefix A: blocks 0, 1 (older)
    b = _chain(pool, 20, 2)  # prefix B: blocks 2, 3
    assert _ids(pool) == [4, 5, 1, 0, 3, 2]  # uncached, then LRU: A's tail, A, B's tail, B
    pool.order.claim([_key(10), _key(11), _key(99)])  # a waiting prompt: A and a block not cached
    assert _ids(pool) == [4, 5, 3, 2, 1, 0]  # A behind B now, its tail first
    _check(pool)
    taken = pool.take_new(4)  # the uncached two, then B (unclaimed), not A
    assert [t.block_id for t in taken] == [4, 5, 3, 2]
    assert set(pool.cached) == {_key(10), _key(11)}
    taken += pool.take_new(1)  # nothing unclaimed is left: A's tail goes, never a hole
    assert taken[-1] is a[1] and set(pool.cached) == {_key(10)}
    assert b[0].key is None
    pool.release(reversed(taken))
    _check(pool)


def test_a_block_whose_last_claim_goes_moves_back_as_the_newest_of_its_kind() -> None:
    pool = BlockPool(num_blocks=6, block_size=2)
    _chain(pool, 10, 2)  # 0, 1
    _chain(pool, 20, 2)  # 2, 3
    chain = [_key(10), _key(11)]
    pool.order.claim(chain)
    pool.order.claim(chain[:1])  # a sibling sharing A's first block
    pool.order.claim([_key(20), _key(21)])  # B, claimed last: first of the claimed run
    assert _ids(pool) == [4, 5, 3, 2, 1, 0]
    assert pool.order.unclaim(chain) is True  # the sibling still claims block 0
    assert _ids(pool) == [4, 5, 1, 3, 2, 0]  # A's tail back as the newest unclaimed block
    _check(pool)
    assert pool.order.unclaim(chain[:1]) is False
    assert _ids(pool) == [4, 5, 1, 0, 3, 2]  # block 0 back too, behind its child
    _check(pool)
    with pytest.raises(ValueError, match="unclaimed"):
        pool.order.unclaim(chain[:1])  # released more often than claimed


def test_blocks_released_while_claimed_queue_claimed_children_first() -> None:
    """A running sequence holds a prefix a waiting one claims (a key it computes counts
    too): released, its blocks go to the claimed run, tail first."""
    pool = BlockPool(num_blocks=5, block_size=2)
    pool.order.claim([_key(1), _key(2), _key(3)])  # claimed before any is cached
    blocks = pool.take_new(3)
    pool.cache_full_blocks(blocks, [_key(1), _key(2), _key(3)], [(1, 1), (2, 2), (3, 3)], None)
    other = pool.take_new(1)  # another prefix, released after them: newer, yet unclaimed
    pool.cache_full_blocks(other, [_key(20)], [(20, 20)], None)
    pool.release(reversed(blocks))
    pool.release(other)
    assert _ids(pool) == [4, 3, 2, 1, 0]  # uncached, unclaimed 3, then 2, 1, 0 tail first
    _check(pool)
    assert [b.block_id for b in pool.take_new(3)] == [4, 3, 2]


def test_within_the_claimed_run_the_latest_claim_goes_first() -> None:
    """The request queued last runs last: its claimed prefix is the first claimed one to go."""
    pool = BlockPool(num_blocks=4, block_size=2)
    _chain(pool, 10, 2)  # 0, 1
    _chain(pool, 20, 2)  # 2, 3
    pool.order.claim([_key(20), _key(21)])  # queued first
    pool.order.claim([_key(10), _key(11)])  # queued behind it
    assert _ids(pool) == [1, 0, 3, 2]
    _check(pool)


def test_a_claimed_spare_stays_claimed_and_returns_to_the_spares() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    _chain(pool, 10, 2)  # 0, 1
    _chain(pool, 20, 2)  # 2, 3
    pool.order.claim([_key(10), _key(11)])
    assert pool.order.set_spares([_key(11)]) == 0  # claimed: reclassified in place
    assert _ids(pool) == [3, 2, 1, 0] and pool.blocks[1].pulled
    pool.order.unclaim([_key(10), _key(11)])
    assert _ids(pool) == [1, 0, 3, 2]  # spares first again
    _check(pool)


def test_with_a_tenant_quota_claims_count_but_order_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, tenant_quota=4)
    _chain(pool, 10, 2)
    _chain(pool, 20, 2)
    before = _ids(pool)
    pool.order.claim([_key(10), _key(11)])
    assert _ids(pool) == before and pool.order.claims == BlockClaims({_key(10): 1, _key(11): 1})
    _check(pool)


def test_reset_takes_claimed_blocks_out_of_the_claimed_run() -> None:
    kv = KVCacheManager(4, 2)
    ctx = HashContext("m")
    prompt = [1, 2, 3, 4, 5]
    kv.allocate_slots("a", prompt, 5, ctx=ctx, prefix=kv.lookup_prefix(prompt, ctx))
    kv.free("a")
    _, keys = kv.expected_prefix(prompt, ctx, kv.claims)
    kv.claim(keys)
    assert kv.reset_prefix_cache() and kv.claims  # the waiting prompt still claims them
    kv.check_invariants()
    kv.unclaim(keys)
    assert not kv.claims
    kv.check_invariants()


def test_cached_run_bisects_a_chain_by_prefix_closure() -> None:
    kv = KVCacheManager(8, 2)
    ctx = HashContext("m")
    prompt = list(range(1, 12))  # 5 full blocks of 2 before the last token
    _, keys = kv.expected_prefix(prompt, ctx, ())
    assert kv.cached_run(keys) == 0
    kv.allocate_slots("a", prompt[:7], 7, ctx=ctx, prefix=kv.lookup_prefix(prompt[:7], ctx))
    assert kv.cached_run(keys) == 3 == kv.lookup_prefix(prompt, ctx).num_tokens // 2
    assert kv.cached_run(keys[:2]) == 2 and kv.cached_run([]) == 0
