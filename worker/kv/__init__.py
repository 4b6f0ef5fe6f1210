"""Paged KV-cache manager (pure Python): block pool, block tables, prefix cache, CoW, events,
lower tiers behind one backend interface (the built-in ones register on import here)."""

from kvstore.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.blocks.hashing import BlockKey, HashContext, block_keys, hash_block
from worker.kv import disk_tier, host_tier  # noqa: F401  (register the "disk", "host" tiers)
from worker.kv.claims import BlockClaims
from worker.kv.manager import KVCacheManager
from worker.kv.tier_backend import TIER_BACKENDS, TierBackend
from worker.kv.types import (
    KVAllocation,
    KVCapacityError,
    KVStats,
    PrefixHit,
    SeqId,
    TierSpec,
    TierStats,
    TierTransfers,
)

__all__ = [
    "AllBlocksCleared",
    "BlockClaims",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "HashContext",
    "KVAllocation",
    "KVCacheManager",
    "KVCapacityError",
    "KVEvent",
    "KVStats",
    "PrefixHit",
    "SeqId",
    "TIER_BACKENDS",
    "TierBackend",
    "TierSpec",
    "TierStats",
    "TierTransfers",
    "block_keys",
    "hash_block",
]
