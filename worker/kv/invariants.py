"""Whole-state consistency checks of the KV manager (O(pool); for tests and debugging)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from worker.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from worker.kv.manager import _Seq


def check_invariants(pool: BlockPool, seqs: Mapping[object, _Seq], caching: bool) -> None:
    """Raise ``AssertionError`` naming the first broken invariant.

    Not written with ``assert`` statements so that ``python -O`` does not disable it.
    """
    bs = pool.block_size
    holders: Counter[int] = Counter()
    for sid, seq in seqs.items():
        ids = [b.block_id for b in seq.blocks]
        _check(len(set(ids)) == len(ids), f"seq {sid!r} holds a block twice: {ids}")
        holders.update(ids)
        n_full = seq.num_computed // bs
        _check(
            len(seq.blocks) == -(-seq.num_computed // bs),
            f"seq {sid!r}: {len(seq.blocks)} blocks for {seq.num_computed} computed tokens",
        )
        _check(
            len(seq.keys) == (n_full if caching else 0),
            f"seq {sid!r}: {len(seq.keys)} keys for {n_full} full blocks",
        )
        for i, block in enumerate(seq.blocks):
            if block.key is not None:
                _check(i < n_full, f"seq {sid!r}: partial block {i} ({block}) is cached")
                _check(block.key == seq.keys[i], f"seq {sid!r}: block {i} has a foreign key")

    for block in pool.blocks:
        _check(
            block.ref_cnt == holders[block.block_id],
            f"{block}: ref count != {holders[block.block_id]} block tables holding it",
        )

    queued: list[int] = []
    prev = pool.free_queue._head
    for block in pool.free_queue:
        _check(block.prev is prev, f"free queue link broken before {block}")
        _check(block.ref_cnt == 0, f"referenced {block} is in the free queue")
        queued.append(block.block_id)
        prev = block
    _check(len(queued) == len(pool.free_queue), "free queue length counter is wrong")
    _check(len(set(queued)) == len(queued), "a block is twice in the free queue")
    unreferenced = {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    _check(set(queued) == unreferenced, "free queue != set of blocks with ref count 0")
    _check(
        len(queued) + sum(1 for b in pool.blocks if b.ref_cnt > 0) == len(pool.blocks),
        "free + in use != total",
    )
    for block in pool.blocks:
        if block.ref_cnt > 0:
            _check(block.prev is None and block.next is None, f"{block} in use keeps links")

    for key, block in pool.cached.items():
        _check(block.key == key, f"cache map entry {key.hex()} points at {block}")
        _check(
            block.token_ids is not None and len(block.token_ids) == bs,
            f"cached {block} lacks its {bs} token ids",
        )
    n_keyed = sum(1 for b in pool.blocks if b.key is not None)
    _check(n_keyed == len(pool.cached), "a block holds a key missing from the cache map")
    evictable = sum(1 for b in pool.cached.values() if b.ref_cnt == 0)
    _check(evictable == pool.num_evictable, "evictable counter is wrong")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)
