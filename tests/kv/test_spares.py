"""Fleet-aware eviction in the pool alone: spares (copies another worker keeps) go before the
rest, whole chains at a time, children before parents; exact eviction orders."""

from __future__ import annotations

from kvstore.blocks.events import BlockRemoved
from kvstore.blocks.hashing import BlockKey
from worker.kv.block_pool import BlockPool
from worker.kv.invariants import check_prefix_closed, record_parents
from worker.kv.spares import spare_verdicts

BS = 2


def _key(name: str, i: int) -> BlockKey:
    return BlockKey(f"{name}{i}".encode().ljust(16, b"."))


def _chain(pool: BlockPool, name: str, n: int, parent: BlockKey | None = None) -> list:
    """Compute ``n`` blocks of chain ``name`` (under ``parent``'s block, held meanwhile) and
    release them tail-first, as a finished sequence does."""
    blocks = pool.take_new(n)
    keys = [_key(name, i) for i in range(n)]
    pool.cache_full_blocks(blocks, keys, [(i, i) for i in range(n)], parent)
    pool.release(reversed(blocks))
    return keys


def _evicted(pool: BlockPool, n: int) -> list[BlockKey]:
    """Keys evicted by handing out ``n`` blocks (kept), in eviction order."""
    pool.events.drain()
    pool.take_new(n)
    return [k for e in pool.events.drain() if isinstance(e, BlockRemoved) for k in e.keys]


def _closed(pool: BlockPool, parents: dict) -> None:
    check_prefix_closed(set(pool.cached), parents)


def test_plain_lru_without_spares() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = _chain(pool, "a", 2)
    b = _chain(pool, "b", 2)
    assert _evicted(pool, 2) == [a[1], a[0]] and set(pool.cached) == set(b)


def test_a_spare_chain_goes_before_an_older_last_copy() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = _chain(pool, "a", 2)
    b = _chain(pool, "b", 2)
    assert pool.order.set_spares([b[1]]) == 2  # b1 named; b0 (its prefix) too: both free, moved
    assert [blk.pulled for blk in pool.cached.values()] == [False, False, True, True]
    assert _evicted(pool, 1) == [b[1]]  # the tail first: prefix-closed
    assert _evicted(pool, 2) == [b[0], a[1]]  # then the last copy, least recent first


def test_blocks_under_a_spare_are_spares_and_go_first_leaf_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=BS)
    a = _chain(pool, "a", 2)
    seq = pool.take_new(3)  # one request: system prompt s (2 blocks), then its question q
    s, q = [_key("s", 0), _key("s", 1)], [_key("q", 0)]
    pool.cache_full_blocks(seq, [*s, *q], [(0, 0), (1, 1), (2, 2)], None)
    pool.release(reversed(seq))
    parents: dict = {}
    for e in pool.events.drain():
        record_parents(e, parents)
    pool.order.set_spares(s)  # a peer keeps s, nobody else has q
    assert pool.cached[q[0]].pulled and pool.cached[s[0]].children == 1
    assert _evicted(pool, 4) == [q[0], s[1], s[0]]  # after the never-used block
    _closed(pool, parents)
    assert set(pool.cached) == set(a)


def test_an_unnamed_block_stops_being_a_spare() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = _chain(pool, "a", 2)
    b = _chain(pool, "b", 2)
    pool.order.set_spares(b)
    assert pool.order.set_spares([]) == 2  # its peer evicted b: b is the fleet's last copy again
    assert not any(blk.pulled for blk in pool.cached.values())
    assert _evicted(pool, 2) == [a[1], a[0]]  # back to least recently used


def test_blocks_in_use_are_classified_and_queue_by_class_on_release() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = _chain(pool, "a", 2)
    held = pool.take_new(2)
    b = [_key("b", 0), _key("b", 1)]
    pool.cache_full_blocks(held, b, [(0, 0), (1, 1)], None)
    assert pool.order.set_spares(b) == 0  # in use: nothing free moved, but flagged
    pool.release(reversed(held))  # released after a, yet evicted before it
    assert _evicted(pool, 4) == [b[1], b[0], a[1], a[0]]


def test_a_landed_copy_is_no_spare_until_used() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = _chain(pool, "a", 2)
    blocks = pool.take_new(2)
    b = [_key("b", 0), _key("b", 1)]
    pool.cache_full_blocks(blocks, b, [(0, 0), (1, 1)], None)
    pool.order.mark_landed(blocks)
    pool.release(reversed(blocks))
    pool.order.set_spares(b)  # a peer keeps b, but the request it landed for has not run yet
    assert not any(blk.pulled for blk in pool.cached.values())
    assert _evicted(pool, 2) == [a[1], a[0]]


def test_a_parent_queued_ahead_of_its_child_waits_behind_it() -> None:
    """The eviction guard: a spare parent whose child is a landed copy (queued with the last
    copies) is not evicted before that child; it is requeued behind it."""
    pool = BlockPool(num_blocks=3, block_size=BS)
    a = _chain(pool, "a", 1)
    p = _chain(pool, "p", 1)
    pool.order.set_spares(p)
    held = pool.lookup(p[0], (0, 0))
    assert held is not None and held.pulled
    pool.touch([held])
    landed = pool.take_new(1)
    c = _key("c", 0)
    pool.cache_full_blocks(landed, [c], [(5, 5)], p[0])
    pool.order.mark_landed(landed)
    pool.release([*landed, held])  # p: a spare; c: landed, queued with the last copies
    assert held.children == 1
    parents: dict = {}
    for e in pool.events.drain():
        record_parents(e, parents)
    parents[p[0]] = None
    assert _evicted(pool, 2) == [a[0], c]  # p reached first, requeued behind c
    _closed(pool, parents)
    assert not held.pulled and _evicted(pool, 1) == [p[0]]


def test_a_tenant_quota_keeps_one_order() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS, tenant_quota=4)
    a = _chain(pool, "a", 2)
    b = _chain(pool, "b", 2)
    assert pool.order.set_spares(b) == 0
    assert _evicted(pool, 2) == [a[1], a[0]]


def test_verdicts_do_not_depend_on_the_maps_order() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    seq = pool.take_new(3)
    keys = [_key("s", 0), _key("s", 1), _key("q", 0)]
    pool.cache_full_blocks(seq, keys, [(0, 0), (1, 1), (2, 2)], None)
    backwards = dict(reversed(pool.cached.items()))  # children before their parents
    want = {keys[0]: True, keys[1]: True, keys[2]: True}
    assert spare_verdicts(backwards, [keys[1]]) == want == spare_verdicts(pool.cached, [keys[1]])
    pool.order.mark_landed(seq[1:2])  # a landed block cuts the inheritance below it
    assert spare_verdicts(backwards, [keys[0]]) == {keys[0]: True, keys[1]: False, keys[2]: False}
