"""What each candidate would serve from cache for a prompt, from the index's per-tier
answer merged with the router's own pending placements (pure: the router passes both in)."""

from __future__ import annotations

from collections.abc import Mapping

from router.placement.placement_types import WorkerId
from router.placement.prefix_source import TierCounts


def cached_tokens(
    ids: list[WorkerId],
    n_tokens: int,
    block_size: int,
    index: Mapping[WorkerId, TierCounts] | None,
    pending: Mapping[WorkerId, int],
    host_hit_weight: float,
) -> tuple[dict[WorkerId, int | None], bool]:
    """Prompt tokens each worker would serve from cache (``None`` where nothing is known),
    and whether a pending placement knew more than the index for any of them.

    Index answer merged (max) with pending placements (leading blocks per worker); capped
    like the engine caps a hit (the last prompt token is always recomputed, whole blocks
    only). Host-tier blocks count ``host_hit_weight`` of a device block (they must be loaded
    back).
    """
    cap = (n_tokens - 1) // block_size if n_tokens else 0
    out: dict[WorkerId, int | None] = {}
    assisted = False
    for w in ids:
        known: float | None = None
        if index is not None:
            dev, host = index.get(w, (0, 0))
            dev = min(dev, cap)
            known = dev + host_hit_weight * min(host, cap - dev)
        mine = pending.get(w, 0)
        if mine and (known is None or mine > known):
            known, assisted = min(mine, cap), True
        out[w] = None if known is None else int(known * block_size)
    return out, assisted


def held_blocks(
    ids: list[WorkerId],
    n_tokens: int,
    block_size: int,
    index: Mapping[WorkerId, TierCounts],
    pending: Mapping[WorkerId, int],
) -> dict[WorkerId, tuple[int, int]]:
    """Per worker, (leading blocks it will have on its device, leading blocks it holds in
    either tier), capped like a hit, unweighted: from where a pull to it starts, and what a
    pull can take from it. The router's pending placements count toward the first (being
    computed or pulled there), never the second: a pull needs blocks that exist."""
    cap = (n_tokens - 1) // block_size if n_tokens else 0
    out = {}
    for w in ids:
        dev, host = index.get(w, (0, 0))
        dev = min(dev, cap)
        out[w] = (max(dev, min(pending.get(w, 0), cap)), min(dev + host, cap))
    return out
