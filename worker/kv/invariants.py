"""Whole-state consistency checks of the KV manager (O(pool); for tests and debugging).

Written with explicit ``raise`` rather than ``assert`` so ``python -O`` cannot disable them,
and with messages built only on failure (the property tests call this after every step).

:func:`check_prefix_closed` checks the cache's PREFIX CLOSURE — every cached key's parent key
is cached too — which the Redis index's bisect lookup relies on (see :mod:`kvstore`). The pool
does not know parents, so the caller rebuilds them from the ``BlockStored`` events
(:func:`record_parents`), exactly as an index consumer would.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, MutableMapping
from typing import TYPE_CHECKING

from kvstore.blocks.events import BlockStored, KVEvent
from kvstore.blocks.hashing import BlockKey
from worker.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from worker.kv.seq_blocks import SeqBlocks


def check_invariants(pool: BlockPool, seqs: Mapping[object, SeqBlocks], caching: bool) -> None:
    """Raise ``AssertionError`` naming the first broken invariant."""
    bs = pool.block_size
    holders: Counter[int] = Counter()
    for sid, seq in seqs.items():
        ids = [b.block_id for b in seq.blocks]
        if len(set(ids)) != len(ids):
            _fail(f"seq {sid!r} holds a block twice: {ids}")
        holders.update(ids)
        if seq.table is not None and seq.table != ids:
            _fail(f"seq {sid!r}: kept block table {seq.table} is not its blocks {ids}")
        n_full = seq.num_computed // bs
        if len(seq.blocks) != -(-seq.num_computed // bs):
            _fail(f"seq {sid!r}: {len(seq.blocks)} blocks for {seq.num_computed} tokens")
        if len(seq.keys) != (n_full if caching else 0):
            _fail(f"seq {sid!r}: {len(seq.keys)} keys for {n_full} full blocks")
        for i, block in enumerate(seq.blocks):
            if block.key is not None and (i >= n_full or block.key != seq.keys[i]):
                _fail(f"seq {sid!r}: block {i} ({block}) is partial or has a foreign key")
            if block.twin_of is not None and (i >= n_full or block.twin_of != seq.keys[i]):
                _fail(f"seq {sid!r}: block {i} ({block}) is a twin of a foreign key")
            # every full block serves its key or twins it: a sequence's keys are all cached
            if caching and i < n_full and seq.keys[i] not in (block.key, block.twin_of):
                _fail(f"seq {sid!r}: full block {i} ({block}) neither serves nor twins its key")

    for block in pool.blocks:
        if block.ref_cnt != holders[block.block_id]:
            _fail(f"{block}: ref count != {holders[block.block_id]} tables holding it")
        if block.ref_cnt > 0 and (block.prev is not None or block.next is not None):
            _fail(f"{block} is in use but still linked into the free queue")
        if block.landing and (block.pulled or block.ref_cnt > 1 or block.key is None):
            _fail(f"{block} landed from a peer but is marked pulled, shared or uncached")

    children: Counter[BlockKey] = Counter(
        b.parent for b in pool.cached.values() if b.parent is not None
    )
    for key, block in pool.cached.items():
        if block.children != children[key]:
            _fail(f"{block}: children {block.children} != {children[key]} cached under it")

    queued: list[int] = []
    fq = pool.free_queue
    prev = fq._head
    region = 0  # the queue's runs: pulled copies, then the rest, then the claimed blocks
    node = fq._head.next
    while node is not fq._tail:
        if node is None or node.prev is not prev:
            _fail(f"free queue link broken before {node}")
        assert node is not None
        prev = node
        if node is fq._mid or node is fq._keep:
            if region != (0 if node is fq._mid else 1):
                _fail("free queue sentinels out of order")
            region += 1
            node = node.next
            continue
        block, node = node, node.next
        claimed = block.key is not None and block.key in pool.order.claims
        if region == 2 and not claimed:
            _fail(f"unclaimed {block} queued among the claimed blocks")
        if region < 2 and claimed and pool.tenant_quota is None:
            _fail(f"claimed {block} queued before unclaimed blocks")
        if region == 1 and block.key is not None and block.pulled:
            if pool.tenant_quota is None:
                _fail(f"pulled {block} queued among the blocks computed here")
        if region == 0 and block.key is not None and not block.pulled:
            _fail(f"{block} queued among the pulled copies")
        if block.ref_cnt != 0:
            _fail(f"referenced {block} is in the free queue")
        queued.append(block.block_id)
    if region != 2:
        _fail("free queue sentinels missing")
    unreferenced = {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    if len(queued) != len(pool.free_queue):
        _fail("free queue length counter is wrong")
    if len(set(queued)) != len(queued) or set(queued) != unreferenced:
        _fail("free queue != set of blocks with ref count 0, each once")
    if len(queued) + len(holders) != len(pool.blocks):
        _fail("free + in use != total")

    for key, block in pool.cached.items():
        if block.key != key:
            _fail(f"cache map entry {key.hex()} points at {block}")
        if block.token_ids is None or len(block.token_ids) != bs:
            _fail(f"cached {block} lacks its {bs} token ids")
    if sum(1 for b in pool.blocks if b.key is not None) != len(pool.cached):
        _fail("a block holds a key missing from the cache map")
    if sum(1 for b in pool.cached.values() if b.ref_cnt == 0) != pool.num_evictable:
        _fail("evictable counter is wrong")
    if pool.tenant_quota is not None:
        _check_tenant_quota(pool)
    _check_twins(pool)


def _check_twins(pool: BlockPool) -> None:
    """Twins: in use, uncached, duplicating a cached key, listed once under that key."""
    listed = 0
    for key, twins in pool.twins.items():
        if not twins:
            _fail(f"empty twin list kept for {key.hex()}")
        if key not in pool.cached:
            _fail(f"twins of {key.hex()} outlived their key (a twin must be promoted)")
        for twin in twins:
            if twin.twin_of != key or twin.key is not None:
                _fail(f"{twin} listed as a twin of {key.hex()} but twin_of={twin.twin_of!r}")
            if twin.ref_cnt == 0:
                _fail(f"twin {twin} is free (a released twin must stop being one)")
            if twin.token_ids is None:
                _fail(f"twin {twin} lacks its token ids (needed to serve after a promotion)")
        listed += len(twins)
        if len({t.block_id for t in twins}) != len(twins):
            _fail(f"a block is listed twice among the twins of {key.hex()}")
    if listed != sum(1 for b in pool.blocks if b.twin_of is not None):
        _fail("a block has twin_of set but is not listed among its key's twins")


def record_parents(event: KVEvent, parents: MutableMapping[BlockKey, BlockKey | None]) -> None:
    """Add the key -> parent links a ``BlockStored`` event names (other events name none).

    A key's parent never changes (keys are chained hashes), so links of evicted keys may stay.
    """
    if isinstance(event, BlockStored):
        parent = event.parent
        for key in event.keys:
            parents[key] = parent
            parent = key


def check_prefix_closed(
    cached: Collection[BlockKey], parents: Mapping[BlockKey, BlockKey | None]
) -> None:
    """Raise ``AssertionError`` unless every cached key's parent is cached (or it is block 0).

    ``cached`` is the cache's key set (e.g. ``KVCacheManager.cached_keys()`` as a set, or a
    set rebuilt from events); ``parents`` comes from :func:`record_parents`.
    """
    for key in cached:
        if key not in parents:
            _fail(f"cached key {key.hex()} was never announced by a BlockStored event")
        parent = parents[key]
        if parent is not None and parent not in cached:
            _fail(f"cached key {key.hex()} has an uncached parent {parent.hex()} (a hole)")


def _fail(message: str) -> None:
    raise AssertionError(message)


def _check_tenant_quota(pool: BlockPool) -> None:
    """Each tenant's evictable list is its evictable cached blocks in free-queue order, and
    within the quota."""
    quota = pool.tenant_quota
    assert quota is not None
    expected: dict[str | None, list[int]] = {}
    for block in pool.free_queue:
        if block.key is not None:
            expected.setdefault(block.tenant, []).append(block.block_id)
    got = {t: list(blocks) for t, blocks in pool.order.by_tenant.items() if blocks}
    if got != expected:
        _fail(f"per-tenant evictable lists {got} != free-queue order {expected}")
    for tenant, ids in got.items():
        if len(ids) > quota:
            _fail(f"tenant {tenant!r} keeps {len(ids)} evictable blocks, quota {quota}")
    for block in pool.blocks:
        if block.key is None and block.tenant is not None:
            _fail(f"uncached {block} still names tenant {block.tenant!r}")
