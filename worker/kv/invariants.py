"""Whole-state consistency checks of the KV manager (O(pool); for tests and debugging).

Written with explicit ``raise`` rather than ``assert`` so ``python -O`` cannot disable them,
and with messages built only on failure (the property tests call this after every step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from worker.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from worker.kv.manager import _Seq


def check_invariants(pool: BlockPool, seqs: Mapping[object, _Seq], caching: bool) -> None:
    """Raise ``AssertionError`` naming the first broken invariant."""
    bs = pool.block_size
    holders: Counter[int] = Counter()
    for sid, seq in seqs.items():
        ids = [b.block_id for b in seq.blocks]
        if len(set(ids)) != len(ids):
            _fail(f"seq {sid!r} holds a block twice: {ids}")
        holders.update(ids)
        n_full = seq.num_computed // bs
        if len(seq.blocks) != -(-seq.num_computed // bs):
            _fail(f"seq {sid!r}: {len(seq.blocks)} blocks for {seq.num_computed} tokens")
        if len(seq.keys) != (n_full if caching else 0):
            _fail(f"seq {sid!r}: {len(seq.keys)} keys for {n_full} full blocks")
        for i, block in enumerate(seq.blocks):
            if block.key is not None and (i >= n_full or block.key != seq.keys[i]):
                _fail(f"seq {sid!r}: block {i} ({block}) is partial or has a foreign key")

    for block in pool.blocks:
        if block.ref_cnt != holders[block.block_id]:
            _fail(f"{block}: ref count != {holders[block.block_id]} tables holding it")
        if block.ref_cnt > 0 and (block.prev is not None or block.next is not None):
            _fail(f"{block} is in use but still linked into the free queue")

    queued: list[int] = []
    prev = pool.free_queue._head
    for block in pool.free_queue:
        if block.prev is not prev:
            _fail(f"free queue link broken before {block}")
        if block.ref_cnt != 0:
            _fail(f"referenced {block} is in the free queue")
        queued.append(block.block_id)
        prev = block
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


def _fail(message: str) -> None:
    raise AssertionError(message)
