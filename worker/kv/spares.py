"""Which cached blocks are spares: copies another worker keeps, evicted before the rest (the
block pool's fleet-aware order, :meth:`~worker.kv.eviction_order.EvictionOrder.set_spares`)."""

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
    block under it unless named. O(len(cached)): one pass."""
    named: set[BlockKey] = set()
    for start in spare:
        key: BlockKey | None = start
        while key is not None and key not in named and key in cached:
            named.add(key)
            key = cached[key].parent
    verdict: dict[BlockKey, bool] = {}
    # The map's order is topological (a key is cached only under a cached parent, and a
    # parent leaves only after its children), so one pass sees each parent first; the walk
    # up is the fallback for an order that is not.
    for key, block in cached.items():
        parent = block.parent
        above = False
        if parent is not None:
            known = verdict.get(parent)
            above = _walk(cached, named, verdict, parent) if known is None else known
        verdict[key] = (above or key in named) and not block.landing
    return verdict


def _walk(
    cached: Mapping[BlockKey, KVBlock],
    named: set[BlockKey],
    verdict: dict[BlockKey, bool],
    start: BlockKey,
) -> bool:
    """The verdict of ``start`` (False if not cached), judging its unjudged ancestors."""
    path: list[KVBlock] = []
    at: BlockKey | None = start
    while at is not None and at not in verdict:
        block = cached.get(at)
        if block is None:
            break
        path.append(block)
        at = block.parent
    flag = verdict.get(at, False) if at is not None else False
    for block in reversed(path):
        assert block.key is not None
        flag = (flag or block.key in named) and not block.landing
        verdict[block.key] = flag
    return verdict.get(start, False)
