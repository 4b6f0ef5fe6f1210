"""The disk tier: the KV manager's view of a :class:`~worker.kv.disk_store.DiskKVStore`.

A :class:`~worker.kv.tier_backend.TierBackend` registered as ``"disk"``, stacked below the
host tier (``TierSpec("disk", n, {"store": store})``). Pure bookkeeping plus the store's
bytes (numpy, no torch): unlike the host tier, whose bytes are the runner's tensors, the disk
tier holds its own (``holds_bytes``), so the runner hands it the KV of the blocks it takes
(:meth:`DiskTier.write_blocks`) and takes loaded KV from it (:meth:`DiskTier.loaded_blocks`).

- **Store on eviction.** A block the host tier evicts (or the device, when the host is
  skipped) gets a staging id from :meth:`DiskTier.store`; the runner reads its KV and hands it
  over with the batch's other blocks, which are queued as chained runs, parent first, on the
  store's writer thread. A block is announced (``BlockStored``, ``Tier.DISK``) and served only
  once its file is durable (:meth:`poll`, once per batch of copies).
- **Reads are checked before adoption.** :meth:`fetch` reads a hit's blocks (checksums
  verified) when the manager looks the prefix up; a block that fails is dropped and the
  prefix is cut there (its tokens are recomputed), so a load can never copy wrong KV. The
  bytes wait here for the adoption (:meth:`checkout`), then for the runner.
- **Exclusive view, inclusive files.** What this tier serves is disjoint from the device and
  the host (the manager's obligations), but a block loaded back keeps its file: if the block
  comes down again it is served from that file without a second write, and a restarted worker
  finds it.
- **Restart.** Built on a directory that holds runs, the tier announces at once the runs whose
  parent chain is complete (block 0 first), under the worker's new epoch; the others stay on
  disk unannounced until written again or evicted.
- **Budget, order and faults** are the store's: its LRU over files, its admission threshold,
  its fault handling (off with one log line: every block reported removed, stores refused,
  the worker runs host-only).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Sequence

import numpy as np

from kvstore.blocks.events import EventLog
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from worker.kv.disk_store import DiskKVStore
from worker.kv.disk_types import DiskRemoved, DiskRun
from worker.kv.tier_backend import TIER_BACKENDS, TierBackend
from worker.kv.tier_block import TierBlock
from worker.kv.types import TierStats

FETCHED_BLOCKS_MAX = 4096  # read-and-checked blocks kept for adoptions that did not fit yet


@TIER_BACKENDS.register
class DiskTier(TierBackend):
    """The blocks ``store`` holds durably, as a tier of about ``num_blocks`` blocks."""

    name = "disk"
    tier = Tier.DISK
    holds_bytes = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: EventLog,
        tenant_quota: int | None = None,
        *,
        store: DiskKVStore,
        fetched_blocks_max: int = FETCHED_BLOCKS_MAX,
    ) -> None:
        self.num_blocks = num_blocks  # the store's budget in blocks (its bytes decide)
        self.block_size = block_size
        self.events = events
        self.tenant_quota = tenant_quota  # 0 keeps nothing; otherwise the store's LRU rules
        self.disk = store  # the run files and their index (its own lock and writer)
        self.on_evict: Callable[[TierBlock], None] | None = None  # the last tier: never set
        self.held: OrderedDict[BlockKey, TierBlock] = OrderedDict()  # served: durable, announced
        self._children: Counter[BlockKey | None] = Counter()  # parent -> its children held
        self._ids = itertools.count()  # staging ids (a block's id here names no storage)
        self._staged: dict[int, TierBlock] = {}  # stored in this batch: bytes come with it
        self._handed: dict[int, TierBlock] = {}  # stored in the batch the runner runs now
        self.fetched_blocks_max = fetched_blocks_max
        self._fetched: OrderedDict[BlockKey, np.ndarray] = OrderedDict()  # read, checked
        self._loading: dict[int, np.ndarray] = {}  # checked out in this batch: id -> bytes
        self._loads: dict[int, np.ndarray] = {}  # checked out in the batch the runner runs
        self._loading_keys: set[BlockKey] = set()  # keys checked out in this batch
        self.num_stored = 0  # blocks handed to the store for writing
        self.num_loaded = 0  # blocks loaded back to the device
        self.num_evicted = 0  # served blocks the store evicted (budget)
        self.num_skipped = 0  # blocks of hits left to recompute (slower to read)
        self.num_failed = 0  # blocks refused at read time (checksum or I/O), recomputed
        self._announce(store.held_runs(), closed=True)

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
        """A staging id for the block's bytes (the runner hands them over with the batch), or
        None: held already, the tier off, or its file still on disk (served again at once)."""
        if key in self.held or self.tenant_quota == 0 or not self.disk.enabled:
            return None
        block = TierBlock(next(self._ids), key, parent, token_ids, tenant)
        if self.disk.lookup([key], [token_ids]):  # a block loaded back earlier: its file stays
            self._hold(block)
            self.events.stored([key], parent, [token_ids], self.block_size, self.tier)
            return None
        self._staged[block.block_id] = block
        self.num_stored += 1
        return block.block_id

    def write_blocks(self, block_ids: Sequence[int], data: object) -> None:
        """Queue the KV of staged blocks (rows of ``data``, one per id) as chained runs."""
        rows = np.asarray(data).reshape(len(block_ids), -1)
        row_of = {i: r for r, i in enumerate(block_ids)}
        blocks = [self._handed.pop(i) for i in block_ids if i in self._handed]
        for run in _chains(blocks):
            payload = np.stack([rows[row_of[b.block_id]] for b in run])
            self.disk.store_run(
                [b.key for b in run], run[0].parent, [b.token_ids for b in run], payload
            )

    def poll(self) -> None:
        """Announce runs that became durable, and drop what the store evicted or lost."""
        for change in self.disk.drain_changes():
            if isinstance(change, DiskRun):
                self._announce([change])  # its parent is on the device or in a tier
            else:
                self._removed(change)

    def refresh(self, keys: Sequence[BlockKey]) -> None:
        self.disk.touch([k for k in keys if k in self.held])

    # ---- loads -----------------------------------------------------------------------------

    def fetch(self, blocks: Sequence[TierBlock]) -> int:
        """Read and check the blocks' bytes (kept until adopted); on a failed read the
        blocks from the failed one on are dropped and the count ready is returned."""
        want = [b for b in blocks if b.key not in self._fetched]
        if want:
            data = self.disk.read([b.key for b in want], [b.token_ids for b in want])
            if data is None:
                return self._fetch_one_by_one(blocks)
            for block, row in zip(want, data, strict=True):
                self._fetched[block.key] = row
        for block in blocks:
            self._fetched.move_to_end(block.key)
        self._trim_fetched(len(blocks))
        return len(blocks)

    def checkout(self, blocks: Sequence[TierBlock]) -> None:
        """Take adopted blocks out of the tier; their fetched bytes wait for the runner."""
        if not blocks:
            return
        for block in blocks:
            data = self._fetched.pop(block.key, None)
            assert data is not None, f"disk {block} adopted without being fetched"
            self._forget(block)
            self._loading[block.block_id] = data
            self._loading_keys.add(block.key)
        self.num_loaded += len(blocks)
        self.events.removed([b.key for b in blocks], self.tier)

    def loaded_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """The checked KV of blocks checked out for the batch the runner runs (uint8 rows)."""
        return np.stack([self._loads.pop(i) for i in block_ids])

    def discard(self, keys: Sequence[BlockKey]) -> None:
        """The device caches ``keys`` now: stop serving them; their files go too, except
        those of blocks just loaded from here (kept: a later eviction needs no write)."""
        gone = [self.held[k] for k in keys if k in self.held]
        for block in gone:
            self._forget(block)
        if gone:
            self.events.removed([b.key for b in gone], self.tier)
        drop = set(keys)
        for staged in (self._staged, self._handed):  # bytes not handed to the store yet
            for i in [i for i, b in staged.items() if b.key in drop]:
                del staged[i]
        for key in keys:
            self._fetched.pop(key, None)
        self.disk.discard([k for k in keys if k not in self._loading_keys])

    def release_pinned(self) -> None:
        """A batch of copies goes to the runner: its stores and loads are the ones it runs
        (anything the runner did not take from the batch before is dropped)."""
        self._handed, self._staged = self._staged, {}
        self._loads, self._loading = self._loading, {}
        self._loading_keys.clear()

    def num_unpinned(self) -> int:
        return self.num_blocks

    def clear(self) -> None:
        """Forget every block served (their files stay: the store checks them if used)."""
        self.held.clear()
        self._children.clear()
        self._staged.clear()
        self._handed.clear()
        self._fetched.clear()
        self._loading.clear()
        self._loads.clear()
        self._loading_keys.clear()

    def load_seconds(self, num_blocks: int) -> float:
        return self.disk.estimated_load_seconds(num_blocks)

    def skipped(self, num_blocks: int) -> None:
        self.num_skipped += num_blocks

    def stats(self) -> TierStats:
        s = self.disk.stats()
        return TierStats(
            self.tier,
            self.num_blocks,
            len(self.held),
            self.num_stored,
            self.num_loaded,
            self.num_evicted,
            capacity_bytes=s.capacity_bytes,
            usage_bytes=s.usage_bytes,
            written_blocks=s.written_blocks,
            read_blocks=s.read_blocks,
            skipped_reads=self.num_skipped,
            failed_reads=self.num_failed,
            dropped_writes=s.dropped_writes,
            enabled=s.enabled,
        )

    def check_invariants(self, device_keys: Container[BlockKey]) -> None:
        for key, block in self.held.items():
            if block.key != key:
                raise AssertionError(f"disk map entry {key.hex()} points at {block}")
            if key in device_keys:
                raise AssertionError(f"key {key.hex()} is cached on the device and on disk")
        if Counter(b.parent for b in self.held.values()) != self._children:
            raise AssertionError("disk children counts differ from the parents of its blocks")

    # ---- internals -------------------------------------------------------------------------

    def _fetch_one_by_one(self, blocks: Sequence[TierBlock]) -> int:
        """A read of the whole hit failed: find the first block that fails, drop it and
        everything after it from this tier, keep what reads."""
        for n, block in enumerate(blocks):
            if block.key in self._fetched:
                continue
            row = self.disk.read([block.key], [block.token_ids])
            if row is None:
                bad = [b for b in blocks[n:] if b.key in self.held]
                self.num_failed += len(bad)
                for b in bad:
                    self._forget(b)
                    self._fetched.pop(b.key, None)
                if bad:
                    self.events.removed([b.key for b in bad], self.tier)
                self._trim_fetched(n)
                return n
            self._fetched[block.key] = row[0]
        self._trim_fetched(len(blocks))
        return len(blocks)

    def _trim_fetched(self, keep_last: int) -> None:
        """Bound the fetched bytes; the last ``keep_last`` (the hit being adopted) stay."""
        excess = len(self._fetched) - max(self.fetched_blocks_max, keep_last)
        for _ in range(max(0, excess)):
            self._fetched.popitem(last=False)

    def _announce(self, runs: Sequence[DiskRun], *, closed: bool = False) -> None:
        """Serve the blocks of ``runs`` (durable in the store) not served yet. ``closed``
        (start-up: nothing else is cached): only runs whose parent chain is complete here,
        ``runs`` coming parents first."""
        for run in runs:
            if closed and run.parent is not None and run.parent not in self.held:
                continue
            parents = (run.parent, *run.keys[:-1])
            fresh = [
                TierBlock(next(self._ids), k, p, t, None)
                for k, p, t in zip(run.keys, parents, run.token_ids, strict=True)
                if k not in self.held
            ]
            if not fresh:
                continue
            for block in fresh:
                self._hold(block)
            i = 0
            while i < len(fresh):  # one event per stretch of consecutive blocks
                j = i + 1
                while j < len(fresh) and fresh[j].parent == fresh[j - 1].key:
                    j += 1
                part = fresh[i:j]
                self.events.stored(
                    [b.key for b in part],
                    part[0].parent,
                    [b.token_ids for b in part],
                    self.block_size,
                    self.tier,
                )
                i = j

    def _removed(self, change: DiskRemoved) -> None:
        gone = [self.held[k] for k in change.keys if k in self.held]
        for block in gone:
            self._forget(block)
            self._fetched.pop(block.key, None)
        if gone:
            if change.reason == "evicted":
                self.num_evicted += len(gone)
            self.events.removed([b.key for b in gone], self.tier)

    def _hold(self, block: TierBlock) -> None:
        self.held[block.key] = block
        self._children[block.parent] += 1

    def _forget(self, block: TierBlock) -> None:
        del self.held[block.key]
        left = self._children[block.parent] - 1
        if left:
            self._children[block.parent] = left
        else:
            del self._children[block.parent]


def _chains(blocks: Sequence[TierBlock]) -> list[list[TierBlock]]:
    """``blocks`` as chained runs, parent first (they arrive children first, several
    prompts mixed): a depth-first walk from each block whose parent is not among them."""
    by_key = {b.key: b for b in blocks}
    children: dict[BlockKey | None, list[TierBlock]] = {}
    for b in blocks:
        children.setdefault(b.parent, []).append(b)
    runs: list[list[TierBlock]] = []
    for root in blocks:
        if root.parent in by_key:
            continue
        stack = [root]
        run: list[TierBlock] = []
        while stack:
            b = stack.pop()
            if run and b.parent != run[-1].key:
                runs.append(run)
                run = []
            run.append(b)
            stack.extend(reversed(children.get(b.key, [])))
        runs.append(run)
    return runs
