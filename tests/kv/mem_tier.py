"""A tier for the tests: a small in-memory backend stacked below the host tier.

It shows what adding a tier takes: one :class:`~worker.kv.tier_backend.TierBackend` and a
registration; the KV manager picks it by name (``TierSpec("test-mem", n)``). It stands in for
a disk tier (its events carry ``Tier.DISK``); its blocks are ids into a store the test keeps.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Sequence

from kvstore.blocks.events import EventLog
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from worker.kv import TIER_BACKENDS, TierBackend, TierStats
from worker.kv.tier_block import TierBlock


@TIER_BACKENDS.register
class MemTier(TierBackend):
    """``num_blocks`` blocks in LRU order; no tenant quota; a fixed load cost per block."""

    name = "test-mem"
    tier = Tier.DISK

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: EventLog,
        tenant_quota: int | None = None,
        *,
        load_s_per_block: float = 0.0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self.load_s_per_block = load_s_per_block
        self.on_evict: Callable[[TierBlock], None] | None = None
        self.free = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[BlockKey, TierBlock] = OrderedDict()
        self.pinned: list[int] = []
        self.children: Counter[BlockKey | None] = Counter()
        self.stored = self.loaded = self.evicted = 0

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, key: object) -> bool:
        return key in self.lru

    def get(self, key: BlockKey) -> TierBlock | None:
        return self.lru.get(key)

    def lookup(self, key: BlockKey, token_ids: tuple[int, ...]) -> TierBlock | None:
        block = self.lru.get(key)
        return block if block is not None and block.token_ids == token_ids else None

    def has_children(self, key: BlockKey) -> bool:
        return self.children[key] > 0

    def keys(self) -> list[BlockKey]:
        return list(self.lru)

    def store(
        self, key: BlockKey, parent: BlockKey | None, token_ids: tuple[int, ...], tenant: str | None
    ) -> int | None:
        if key in self.lru:
            return None
        if not self.free:
            if not self.lru:
                return None
            oldest = next(iter(self.lru.values()))
            self._drop(oldest)
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(oldest)
        block = TierBlock(self.free.pop(), key, parent, token_ids, tenant)
        self.lru[key] = block
        self.children[parent] += 1
        self.stored += 1
        self.events.stored([key], parent, [token_ids], self.block_size, self.tier)
        return block.block_id

    def refresh(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)

    def checkout(self, blocks: Sequence[TierBlock]) -> None:
        for block in blocks:
            self._forget(block)
            self.pinned.append(block.block_id)
        self.loaded += len(blocks)
        self.events.removed([b.key for b in blocks], self.tier)

    def discard(self, keys: Sequence[BlockKey]) -> None:
        gone = [self.lru[k] for k in keys if k in self.lru]
        for block in gone:
            self._drop(block, announce=False)
        if gone:
            self.events.removed([b.key for b in gone], self.tier)

    def release_pinned(self) -> None:
        self.free += self.pinned
        self.pinned.clear()

    def num_unpinned(self) -> int:
        return self.num_blocks - len(self.pinned)

    def clear(self) -> None:
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.lru.clear()
        self.pinned.clear()
        self.children.clear()

    def load_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.load_s_per_block

    def stats(self) -> TierStats:
        return TierStats(
            self.tier, self.num_blocks, len(self.lru), self.stored, self.loaded, self.evicted
        )

    def check_invariants(self, device_keys: Container[BlockKey]) -> None:
        ids = sorted([b.block_id for b in self.lru.values()] + self.free + self.pinned)
        assert ids == list(range(self.num_blocks)), f"test tier ids lost: {ids}"
        assert all(k not in device_keys for k in self.lru), "a key on the device too"
        assert +self.children == Counter(b.parent for b in self.lru.values())

    def _drop(self, block: TierBlock, *, announce: bool = True) -> None:
        self._forget(block)
        self.free.append(block.block_id)
        if announce:
            self.events.removed([block.key], self.tier)

    def _forget(self, block: TierBlock) -> None:
        del self.lru[block.key]
        self.children[block.parent] -= 1
