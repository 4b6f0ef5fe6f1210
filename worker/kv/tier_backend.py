"""The interface of a KV tier below the device, and the registry that names the backends.

A KV manager stacks an ordered list of lower tiers under its device pool, fastest first
(``KVCacheManager(..., lower_tiers=[TierSpec("host", n), ...])``, or ``host_num_blocks``). A
block the device evicts is offered to the first tier, a block tier i evicts to tier i+1 (store
on eviction); a prompt's prefix that ends on the device continues through the tiers, key by key,
each key in the first tier holding it; adopting it loads those blocks back to the device. A
backend is bookkeeping only (ids, keys, order, events): the bytes are the model runner's, moved
by the copies the manager hands it (:class:`~worker.kv.types.TierTransfers`).

Adding a tier: subclass :class:`TierBackend`, set ``name`` and ``tier``, decorate the class
with ``@TIER_BACKENDS.register`` and import its module once (``worker/kv/__init__.py`` imports
the built-in ones); configuration then picks it by name. The manager needs no edit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Sequence
from typing import ClassVar

from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from kvstore.runtime.registry import Registry
from worker.kv.tier_block import TierBlock
from worker.kv.types import TierStats


class TierBackend(ABC):
    """One tier below the device: a bounded set of cached blocks, each under its key.

    Constructed by the manager as ``cls(num_blocks, block_size, events, tenant_quota,
    **options)``: ``events`` is the device pool's log (one ordered stream for every tier),
    ``tenant_quota`` the most blocks one tenant keeps here (None: no quota), ``options`` the
    :class:`~worker.kv.types.TierSpec`'s keywords.

    What the backend guarantees:

    - Events: every key it starts holding is announced by a ``BlockStored`` and every key it
      stops holding by a ``BlockRemoved``, both carrying its ``tier``, in ``events``.
    - Tiers are exclusive: it never holds a key the device caches (the manager calls
      :meth:`discard` when the device caches a key again) nor one another lower tier holds.
    - Prefix closure of the union: it evicts a block only when none of its descendants is
      held here (e.g. LRU order: blocks arrive children first); a held key's parent is on the
      device or in some tier.
    - Ids: a block read by a pending load (:meth:`checkout`) is not reused before
      :meth:`release_pinned` (the runner's copies of the step may still read it).

    What the caller (the manager) does:

    - store a run of evicted blocks: :meth:`store` each, in the order they were evicted
      (children first), and copy the block's KV into the returned id; a block this tier
      evicts to make room is passed to ``on_evict`` (set by the manager: the tier below) after
      its ``BlockRemoved``, before its id is reused;
    - find the longest chained prefix held: walk the chain key by key with :meth:`lookup`
      (token ids compared, so a collision can never load wrong KV); ask
      :meth:`load_seconds` whether loading beats recomputing;
    - pin and load back: :meth:`checkout` the adopted blocks (they leave the tier), copy
      each into its device block, then :meth:`release_pinned` once the copies ran;
    - drop: :meth:`discard` keys the device caches again, :meth:`clear` on a cache reset (the
      pool's ``AllBlocksCleared`` covers every tier);
    - read its figures with :meth:`stats` and check it with :meth:`check_invariants`.
    """

    name: ClassVar[str]  # the registry name configuration picks the tier by
    tier: ClassVar[Tier]  # the tier its events carry

    num_blocks: int  # capacity in blocks
    on_evict: Callable[[TierBlock], None] | None  # the tier below's intake (None: drop)

    @abstractmethod
    def __len__(self) -> int:
        """Blocks held now."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether a block here caches ``key``."""

    @abstractmethod
    def get(self, key: BlockKey) -> TierBlock | None:
        """The block caching ``key`` (no token check: for exports and adoption re-checks)."""

    @abstractmethod
    def lookup(self, key: BlockKey, token_ids: tuple[int, ...]) -> TierBlock | None:
        """The block caching ``key`` if its token ids match too (a pure query)."""

    @abstractmethod
    def has_children(self, key: BlockKey) -> bool:
        """Whether a block here continues ``key`` (dropping ``key`` would leave a hole)."""

    @abstractmethod
    def keys(self) -> list[BlockKey]:
        """Every key held, e.g. to resync the block index."""

    @abstractmethod
    def store(
        self, key: BlockKey, parent: BlockKey | None, token_ids: tuple[int, ...], tenant: str | None
    ) -> int | None:
        """Take a block; returns the id its KV must be copied into, or None if it is not
        kept (held already, no room, quota 0). May evict (``on_evict``) to make room."""

    @abstractmethod
    def refresh(self, keys: Sequence[BlockKey]) -> None:
        """Make ``keys`` (a chain, parents first) the last to be evicted; unknown keys skipped."""

    @abstractmethod
    def checkout(self, blocks: Sequence[TierBlock]) -> None:
        """Take ``blocks`` out of the tier for a load back to the device (``BlockRemoved``);
        their ids stay pinned until :meth:`release_pinned`."""

    @abstractmethod
    def discard(self, keys: Sequence[BlockKey]) -> None:
        """Drop the blocks of ``keys`` held here (``BlockRemoved``); unknown keys skipped."""

    @abstractmethod
    def release_pinned(self) -> None:
        """The step's copies ran: pinned ids become reusable."""

    @abstractmethod
    def num_unpinned(self) -> int:
        """Blocks a run of stores can use without touching a pinned id (held or free)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every block (no event: the pool's ``AllBlocksCleared`` covers the tiers)."""

    @abstractmethod
    def load_seconds(self, num_blocks: int) -> float:
        """Estimated seconds to load ``num_blocks`` blocks back to the device, which a caller
        compares with recomputing their tokens (0.0: always worth it)."""

    # ---- tiers whose bytes live outside the runner (a disk); the defaults suit the others --

    holds_bytes: ClassVar[bool] = False  # True: the runner hands it bytes (write_blocks) and
    # takes loaded bytes from it (loaded_blocks) instead of copying into tensors of its own

    def poll(self) -> None:
        """Take in what changed outside the manager's calls (e.g. writes that became durable,
        blocks a store evicted), announcing it in ``events``. Called once per batch of copies
        (``TierChain.take_transfers``)."""
        return None  # nothing changes behind the manager's back in most tiers

    def fetch(self, blocks: Sequence[TierBlock]) -> int:
        """Make the bytes of ``blocks`` (a prefix's blocks held here, in order) ready for a
        load before the caller commits to it; returns how many leading ones are ready (the
        rest are recomputed). A block that fails a check is dropped here (``BlockRemoved``)."""
        return len(blocks)

    def skipped(self, num_blocks: int) -> None:
        """A prefix hit left ``num_blocks`` of its blocks here to recompute (slower to load)."""
        return None  # counted only by tiers that report skipped reads

    def write_blocks(self, block_ids: Sequence[int], data: object) -> None:
        """``holds_bytes`` tiers: the KV of the blocks :meth:`store` returned ``block_ids``
        for, one row per id (``data``: uint8 ``[len(block_ids), block_bytes]``)."""
        raise TypeError(f"{self.name} tier holds no bytes (holds_bytes is False): the runner does")

    def loaded_blocks(self, block_ids: Sequence[int]) -> object:
        """``holds_bytes`` tiers: the KV of checked-out blocks ``block_ids`` (uint8 rows)."""
        raise TypeError(f"{self.name} tier holds no bytes (holds_bytes is False): the runner does")

    @abstractmethod
    def stats(self) -> TierStats:
        """Its figures now (``hit_tokens`` is the manager's count: 0 here)."""

    @abstractmethod
    def check_invariants(self, device_keys: Container[BlockKey]) -> None:
        """Raise ``AssertionError`` naming the first broken invariant; ``device_keys``: the
        keys the device caches (none may be held here too)."""


TIER_BACKENDS: Registry[type[TierBackend]] = Registry("KV tier backend")
"""Tier backends by name (``@TIER_BACKENDS.register``); an unknown name lists the valid ones."""
