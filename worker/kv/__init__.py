"""Paged KV-cache manager (pure Python): block pool, block tables, prefix cache, CoW, events."""

from kvstore.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.blocks.hashing import BlockKey, HashContext, block_keys, hash_block
from worker.kv.claims import BlockClaims
from worker.kv.manager import KVCacheManager
from worker.kv.types import (
    KVAllocation,
    KVCapacityError,
    KVStats,
    PrefixHit,
    SeqId,
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
    "TierTransfers",
    "block_keys",
    "hash_block",
]
