"""What each candidate would serve from cache for a prompt, from the index's per-tier
answer merged with the router's own pending placements (pure: the router passes both in)."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.blocks.tiers import HELD_TIERS, Tier, TierBlocks
from router.placement.placement_types import WorkerId


def cached_tokens(
    ids: list[WorkerId],
    n_tokens: int,
    block_size: int,
    index: Mapping[WorkerId, TierBlocks] | None,
    pending: Mapping[WorkerId, int],
    tier_weights: Mapping[Tier, float],
) -> tuple[dict[WorkerId, int | None], bool]:
    """Prompt tokens each worker would serve from cache (``None`` where nothing is known),
    and whether a pending placement knew more than the index for any of them.

    Index answer merged (max) with pending placements (leading blocks per worker); capped
    like the engine caps a hit (the last prompt token is always recomputed, whole blocks
    only). A block counts its tier's weight in ``tier_weights`` (a device block 1: the
    others must be loaded back first); a tier without a weight counts nothing.
    """
    cap = (n_tokens - 1) // block_size if n_tokens else 0
    out: dict[WorkerId, int | None] = {}
    assisted = False
    for w in ids:
        known: float | None = None
        if index is not None:
            known = weighted_blocks(index.get(w, _NONE), cap, tier_weights)
        mine = pending.get(w, 0)
        if mine and (known is None or mine > known):
            known, assisted = min(mine, cap), True
        out[w] = None if known is None else int(known * block_size)
    return out, assisted


def held_blocks(
    ids: list[WorkerId],
    n_tokens: int,
    block_size: int,
    index: Mapping[WorkerId, TierBlocks],
    pending: Mapping[WorkerId, int],
) -> dict[WorkerId, tuple[int, int]]:
    """Per worker, (leading blocks it will have on its device, leading blocks it holds in
    any tier), capped like a hit, unweighted: from where a pull to it starts, and what a
    pull can take from it. The router's pending placements count toward the first (being
    computed or pulled there), never the second: a pull needs blocks that exist."""
    cap = (n_tokens - 1) // block_size if n_tokens else 0
    out = {}
    for w in ids:
        counts = index.get(w, _NONE)
        dev = min(counts.get(Tier.DEVICE, 0), cap)
        out[w] = (max(dev, min(pending.get(w, 0), cap)), min(sum(counts.values()), cap))
    return out


def weighted_blocks(counts: TierBlocks, cap: int, tier_weights: Mapping[Tier, float]) -> float:
    """A worker's leading blocks, each weighed by its tier, fastest tier first, up to ``cap``
    blocks in all."""
    total, left = 0.0, cap
    for tier in HELD_TIERS:
        n = min(counts.get(tier, 0), left)
        if n:
            total += tier_weights.get(tier, 0.0) * n
            left -= n
    return total


_NONE: TierBlocks = {}


def held_anywhere(
    index: Mapping[WorkerId, TierBlocks] | None, n_tokens: int, block_size: int
) -> int:
    """Prompt tokens the worker of the index holding the most of the prompt holds (every tier,
    unweighted, capped like a hit); 0 without an index answer."""
    if not index:
        return 0
    cap = (n_tokens - 1) // block_size if n_tokens else 0
    return min(max(sum(counts.values()) for counts in index.values()), cap) * block_size
