"""Values the disk KV store hands its caller: runs held, removals, pins and counters."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.blocks.hashing import BlockKey


@dataclass(frozen=True, slots=True)
class DiskRun:
    """A chained run of blocks the store holds (durably written), parent first."""

    keys: tuple[BlockKey, ...]  # chained keys
    parent: BlockKey | None  # key of the block before keys[0] (None: keys[0] is block 0)
    token_ids: tuple[tuple[int, ...], ...]  # each block's tokens

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class DiskRemoved:
    """Keys the store no longer holds (evicted, discarded, or found corrupt)."""

    keys: tuple[BlockKey, ...]
    reason: str  # "evicted", "discarded" or "corrupt"


@dataclass(slots=True)
class DiskPin:
    """Files pinned for a coming read (see ``DiskKVStore.pin``); release exactly once."""

    keys: tuple[BlockKey, ...]  # the leading keys asked for that the store holds
    files: tuple[str, ...]  # run files holding them, one pin each
    released: bool = False

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    """A snapshot of the store's counters (monotonic since open, except the gauges)."""

    enabled: bool  # False once the store turned itself off (or with no budget)
    capacity_bytes: int  # the byte budget
    usage_bytes: int  # gauge: bytes of run files held (and being written)
    blocks: int  # gauge: blocks held
    files: int  # gauge: run files held
    queued_writes: int  # gauge: runs waiting for the writer thread
    reads: int  # read calls that served blocks
    read_blocks: int
    read_bytes: int
    read_misses: int  # read calls that served nothing (missing, mismatched or corrupt)
    writes: int  # run files written durably
    written_blocks: int
    written_bytes: int
    dropped_writes: int  # runs not written: queue full, no room, or store off
    not_admitted: int  # blocks offered once under an admission threshold of two
    skipped_reads: int  # hits not read because recomputing was estimated faster
    evictions: int  # blocks evicted to stay within the budget
    corrupt: int  # blocks or files refused by a check (never served), deleted
    errors: int  # I/O errors (the first write error turns the store off)
    read_bytes_per_s: float  # the current read-rate estimate
    off_reason: str = ""  # why the store is off ("" while enabled)
