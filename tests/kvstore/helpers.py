"""Test helpers on the KV manager's side: event builders and a tiny block pool."""

from __future__ import annotations

import threading

from kvstore.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.blocks.hashing import BlockKey, block_keys
from kvstore.blocks.tiers import Tier


def tiers(device: int, host: int = 0) -> dict[Tier, int]:
    """A per-tier lookup answer of one worker (the tiers holding nothing left out)."""
    return {t: n for t, n in ((Tier.DEVICE, device), (Tier.HOST, host)) if n}


def chain(n: int, salt: int = 0) -> list[BlockKey]:
    """Keys of an n-block prompt; different salts give unrelated chains."""
    return block_keys([salt * 1_000_003 + i for i in range(4 * n)], 4)


def stored(keys: list[BlockKey], parent: BlockKey | None = None) -> BlockStored:
    return BlockStored(0, tuple(keys), parent, (), 4)


def removed(*keys: BlockKey) -> BlockRemoved:
    return BlockRemoved(0, tuple(keys))


class Pool:
    """The worker's cache as a set of keys; emits the events a KV manager would."""

    def __init__(self) -> None:
        self._keys: dict[BlockKey, None] = {}
        self._lock = threading.Lock()

    def store(self, keys: list[BlockKey], parent: BlockKey | None = None) -> list[object]:
        with self._lock:
            self._keys.update(dict.fromkeys(keys))
        return [stored(keys, parent)]

    def evict(self, *keys: BlockKey) -> list[object]:
        with self._lock:
            for key in keys:
                del self._keys[key]
        return [removed(*keys)]

    def clear(self) -> list[object]:
        with self._lock:
            self._keys.clear()
        return [AllBlocksCleared(0)]

    def list_cached_keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._keys)
