"""Which cached blocks are spares: copies another worker keeps, evicted before the rest (the
block pool's fleet-aware order, :meth:`~worker.kv.block_pool.BlockPool.set_spares`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvstore.blocks.hashing import BlockKey
from worker.kv.free_queue import KVBlock


def spare_verdicts(
    cached: Mapping[BlockKey, KVBlock], spare: Iterable[BlockKey]
) -> dict[BlockKey, bool]:
    """For every cached key, whether its block is a spare, given ``spare``: keys the index
    says another worker keeps.

    A named key makes its ancestors spares too (the peer's cache is prefix-closed: holding a
    block it holds the prefix; with ``record_every > 1`` the index names only every k-th key)
    and the blocks cached under it (a child must be evicted no later than its parent). A landed
    copy, not yet used by the request it was pulled for, is never a spare, and neither is a
    block under it unless named. O(len(cached)): each key's chain is walked once."""
    named: set[BlockKey] = set()
    for start in spare:
        key: BlockKey | None = start
        while key is not None and key not in named and key in cached:
            named.add(key)
            key = cached[key].parent
    verdict: dict[BlockKey, bool] = {}
    for start, first in cached.items():
        path: list[KVBlock] = []
        at: BlockKey | None = start
        block = first
        while at not in verdict:  # up to the first judged (or uncached) ancestor
            path.append(block)
            at = block.parent
            above = cached.get(at) if at is not None else None
            if above is None:
                break
            block = above
        flag = verdict.get(at, False) if at is not None else False
        for block in reversed(path):
            assert block.key is not None
            flag = (flag or block.key in named) and not block.landing
            verdict[block.key] = flag
    return verdict
