"""KV events: what the block index (Redis) must learn about this worker's prefix cache.

Every block that becomes cached emits :class:`BlockStored`, every eviction :class:`BlockRemoved`,
a cache reset :class:`AllBlocksCleared` (every tier). Stored/removed events carry
the :class:`~kvstore.blocks.tiers.Tier` the blocks entered or left (``DEVICE`` for the paged KV
cache, lower tiers for blocks kept after their eviction from the one above); a key is held by at
most one tier; the device's key set is prefix-closed, and so is the union of all tiers.
Events carry a monotonically increasing ``seq`` so a
consumer can detect gaps and apply batches in order. Events are batched per call site: one
allocation that fills five chained blocks emits one ``BlockStored`` with five keys, and the
evictions it causes one ``BlockRemoved``. The engine drains the log once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of chained blocks became cached (``keys[i]``'s parent is ``keys[i-1]``)."""

    seq: int  # position in this manager's event stream (monotonic, starts at 0)
    keys: tuple[BlockKey, ...]  # keys of the newly cached blocks, in chain order
    parent: BlockKey | None  # key of the block before keys[0]; None when keys[0] is block 0
    token_ids: tuple[tuple[int, ...], ...]  # token ids of each stored block
    block_size: int  # tokens per block
    tier: Tier = Tier.DEVICE  # which tier now holds them


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted: their keys are no longer served by this worker."""

    seq: int  # position in the event stream
    keys: tuple[BlockKey, ...]  # keys evicted, in eviction order
    tier: Tier = Tier.DEVICE  # the tier they left


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset): forget every key of this worker."""

    seq: int  # position in the event stream


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """Append-only buffer of events with a monotonic sequence number; drained by the caller."""

    __slots__ = ("_events", "_next_seq")

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._next_seq = 0

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def stored(
        self,
        keys: list[BlockKey],
        parent: BlockKey | None,
        token_ids: list[tuple[int, ...]],
        block_size: int,
        tier: Tier = Tier.DEVICE,
    ) -> None:
        self._events.append(
            BlockStored(self._take_seq(), tuple(keys), parent, tuple(token_ids), block_size, tier)
        )

    def removed(self, keys: list[BlockKey], tier: Tier = Tier.DEVICE) -> None:
        self._events.append(BlockRemoved(self._take_seq(), tuple(keys), tier))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared(self._take_seq()))

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)
