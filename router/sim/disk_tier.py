"""The simulated worker's disk tier: the bookkeeping of ``worker/kv/disk_tier.py``, no files.

A :class:`~worker.kv.tier_backend.TierBackend` registered as ``"sim_disk"`` and stacked below
the host tier of the simulator's real :class:`~worker.kv.KVCacheManager`, so the manager's
own rules decide what reaches it and what is loaded back (store on eviction from the host
tier, longest chained prefix, and ``TierChain.worth_loading``: a disk hit is loaded only when
:meth:`SimDiskTier.load_seconds` is below the engine's recompute estimate). What it keeps of
the real tier (``DiskTier`` over a ``DiskKVStore``):

- **Exclusive view, inclusive files.** It serves (announces, ``Tier.DISK``) only blocks
  neither the device nor the host holds, but a block loaded back keeps its "file": when it
  comes down again it is served at once, with no second write, and the file still counts
  against the budget meanwhile. A key the device recomputes loses its file (``discard``).
- **Budget and order.** At most ``num_blocks`` files, the least recently written or read
  going first (a served block whose file goes is announced removed).
- **Admission.** ``admit_after=2`` writes a block only the second time it is offered (a
  bounded memory of keys offered once, bounded as the store bounds it).

What it leaves out, as not moving a hit rate: files of up to 32 blocks (the budget and the
LRU here are per block), the writer thread (a block is served at once, not once durable; no
write is dropped for a full queue), checksums and faults.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Sequence

from kvstore.blocks.events import EventLog
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from worker.kv.disk_admission import DiskAdmission
from worker.kv.tier_backend import TIER_BACKENDS, TierBackend
from worker.kv.tier_block import TierBlock
from worker.kv.types import TierStats


@TIER_BACKENDS.register
class SimDiskTier(TierBackend):
    """``num_blocks`` block files in LRU order; serves those above tiers do not hold."""

    name = "sim_disk"
    tier = Tier.DISK

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: EventLog,
        tenant_quota: int | None = None,
        *,
        load_s_per_token: float,
        admit_after: int = 1,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self.tenant_quota = tenant_quota  # 0 keeps nothing (the real tier's rule)
        self.load_s_per_token = load_s_per_token  # the time model's read cost
        self.on_evict: Callable[[TierBlock], None] | None = None  # the last tier: never set
        self.files: OrderedDict[BlockKey, TierBlock] = OrderedDict()  # written; LRU first
        self.held: dict[BlockKey, TierBlock] = {}  # served: files no tier above holds
        self._children: Counter[BlockKey | None] = Counter()  # parent -> its children held
        self._admission = DiskAdmission(admit_after, num_blocks)
        self._loading: set[BlockKey] = set()  # checked out in this batch: files kept
        self._ids = itertools.count()  # staging ids (no storage behind them)
        self.num_stored = 0  # blocks written (admitted, not already on file)
        self.num_loaded = 0  # blocks loaded back to the device
        self.num_evicted = 0  # served blocks whose file the budget dropped
        self.num_skipped = 0  # blocks of hits left to recompute (slower to read)
        self.num_not_admitted = 0  # offers refused by admit_after=2

    # ---- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, key: object) -> bool:
        return key in self.held

    def get(self, key: BlockKey) -> TierBlock | None:
        return self.held.get(key)

    def lookup(self, key: BlockKey, token_ids: tuple[int, ...]) -> TierBlock | None:
        block = self.held.get(key)
        return block if block is not None and block.token_ids == token_ids else None

    def has_children(self, key: BlockKey) -> bool:
        return key in self._children

    def keys(self) -> list[BlockKey]:
        return list(self.held)

    # ---- stores ----------------------------------------------------------------------------

    def store(
        self, key: BlockKey, parent: BlockKey | None, token_ids: tuple[int, ...], tenant: str | None
    ) -> int | None:
        """A staging id (the write), or None: held already, quota 0, not admitted yet, or
        its file still here (served again at once, no write)."""
        if key in self.held or self.tenant_quota == 0:
            return None
        block = TierBlock(next(self._ids), key, parent, token_ids, tenant)
        on_file = self.files.get(key)
        if on_file is not None and on_file.token_ids == token_ids:
            self._hold(block)
            self.files[key] = block
            return None
        if not self._admit(key):
            return None
        self.files[key] = block
        self.num_stored += 1
        self._hold(block)
        while len(self.files) > self.num_blocks:  # the oldest first: never the new one
            self._drop_file(next(iter(self.files)))
        return block.block_id

    def refresh(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if key in self.held:
                self.files.move_to_end(key)

    # ---- loads and drops -------------------------------------------------------------------

    def checkout(self, blocks: Sequence[TierBlock]) -> None:
        """Adopted blocks leave the served set; their files stay (a read makes them recent)."""
        if not blocks:
            return
        for block in blocks:
            self._forget(block)
            self.files.move_to_end(block.key)
            self._loading.add(block.key)
        self.num_loaded += len(blocks)
        self.events.removed([b.key for b in blocks], self.tier)

    def discard(self, keys: Sequence[BlockKey]) -> None:
        """The device caches ``keys`` now: stop serving them; their files go too, except
        those of blocks just loaded from here."""
        gone = [self.held[k] for k in keys if k in self.held]
        for block in gone:
            self._forget(block)
        if gone:
            self.events.removed([b.key for b in gone], self.tier)
        for key in keys:
            if key not in self._loading:
                self.files.pop(key, None)

    def release_pinned(self) -> None:
        self._loading.clear()

    def num_unpinned(self) -> int:
        return self.num_blocks

    def clear(self) -> None:
        """Forget every block served (the files stay, as the real tier's do)."""
        self.held.clear()
        self._children.clear()
        self._loading.clear()

    def load_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.block_size * self.load_s_per_token

    def skipped(self, num_blocks: int) -> None:
        self.num_skipped += num_blocks

    def stats(self) -> TierStats:
        return TierStats(
            self.tier,
            self.num_blocks,
            len(self.held),
            self.num_stored,
            self.num_loaded,
            self.num_evicted,
            written_blocks=self.num_stored,
            read_blocks=self.num_loaded,
            skipped_reads=self.num_skipped,
        )

    def check_invariants(self, device_keys: Container[BlockKey]) -> None:
        if len(self.files) > self.num_blocks:
            raise AssertionError(f"sim disk holds {len(self.files)} files, size {self.num_blocks}")
        for key in self.held:
            if key not in self.files:
                raise AssertionError(f"sim disk serves {key.hex()} without its file")
            if key in device_keys:
                raise AssertionError(f"key {key.hex()} is cached on the device and on disk")
        if Counter(b.parent for b in self.held.values()) != self._children:
            raise AssertionError("sim disk children counts differ from the parents of its blocks")

    # ---- internals -------------------------------------------------------------------------

    def _admit(self, key: BlockKey) -> bool:
        if self._admission.admit(key):
            return True
        self.num_not_admitted += 1
        return False

    def _drop_file(self, key: BlockKey) -> None:
        del self.files[key]
        block = self.held.get(key)
        if block is not None:
            self._forget(block)
            self.num_evicted += 1
            self.events.removed([key], self.tier)

    def _hold(self, block: TierBlock) -> None:
        self.held[block.key] = block
        self._children[block.parent] += 1
        self.events.stored([block.key], block.parent, [block.token_ids], self.block_size, self.tier)

    def _forget(self, block: TierBlock) -> None:
        del self.held[block.key]
        left = self._children[block.parent] - 1
        if left:
            self._children[block.parent] = left
        else:
            del self._children[block.parent]
