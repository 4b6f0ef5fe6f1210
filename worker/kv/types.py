"""Ids, result types and errors passed between the KV manager and its callers."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.blocks.hashing import BlockKey, HashContext
from kvstore.blocks.tiers import Tier
from kvstore.requests.histograms import HistogramCounts

if TYPE_CHECKING:
    from worker.kv.free_queue import KVBlock

SeqId = Hashable
"""A sequence's id (request id, or request id + sample index): any hashable, e.g. str or int."""


class KVCapacityError(Exception):
    """A sequence can never fit: it needs more blocks than the whole pool holds.

    Raised instead of returning ``None`` (which means "does not fit *now*, retry later"), so a
    scheduler can reject the request instead of waiting forever. Fix: shorten the request or
    give the worker more KV blocks.
    """


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Result of :meth:`KVCacheManager.lookup_prefix`: cached leading blocks of a prompt."""

    block_ids: tuple[int, ...]  # physical ids of the device hit blocks, logical order
    keys: tuple[BlockKey, ...]  # chained keys of the whole hit: device blocks, then lower ones
    num_tokens: int  # tokens covered = len(keys) * block_size; <= len(prompt) - 1
    ctx: HashContext | None = None  # context the keys were computed with (checked on adoption)
    num_host_tokens: int = 0  # of num_tokens, those in the host tier (loaded on adoption)
    num_lower_tokens: int = 0  # of num_tokens, those in any tier below the device (host too)

    @staticmethod
    def empty(ctx: HashContext | None = None) -> PrefixHit:
        return PrefixHit((), (), 0, ctx)


@dataclass(slots=True)
class KVAllocation:
    """Result of a successful :meth:`KVCacheManager.allocate_slots`."""

    new_block_ids: list[int]  # blocks appended to the block table by this call (CoW dst first)
    num_cached_tokens: int  # prefix-hit tokens adopted in this call (0 for running sequences)
    copies: list[tuple[int, int]] = field(default_factory=list)  # CoW (src, dst) of this call
    num_host_tokens: int = 0  # of num_cached_tokens, those loaded back from the host tier
    num_lower_tokens: int = 0  # of num_cached_tokens, those loaded from any lower tier


@dataclass(slots=True)
class TierTransfers:
    """Copies between tiers the model runner must make before the step's copy-on-write
    copies and forward pass (see ``KVCacheManager.take_transfers``), in three phases:

    1. ``moves``, one by one in order: copies between two lower tiers (a block the host tier
       evicted into the tier below it); they read blocks phase 2 may overwrite;
    2. ``to_host`` and ``stores``: blocks the device evicted, stored into a lower tier (a
       block evicted again further down in the same batch is copied from the device);
    3. ``to_device`` and ``loads``: lower-tier blocks loaded back into fresh device blocks.

    Device <-> host copies have their own lists of id pairs (the runner batches each into one
    copy); the others are :data:`TierCopy` tuples naming both tiers."""

    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device, host): offloads
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (host, device): loads
    moves: list[TierCopy] = field(default_factory=list)  # lower tier -> lower tier
    stores: list[TierCopy] = field(default_factory=list)  # device -> a tier below the host
    loads: list[TierCopy] = field(default_factory=list)  # a tier below the host -> device

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device or self.moves or self.stores or self.loads)

    def add(self, src: Tier, src_id: int, dst: Tier, dst_id: int) -> None:
        """Record one block copy from ``src`` block ``src_id`` to ``dst`` block ``dst_id``."""
        if src is Tier.DEVICE:
            if dst is Tier.HOST:
                self.to_host.append((src_id, dst_id))
            else:
                self.stores.append((src, src_id, dst, dst_id))
        elif dst is Tier.DEVICE:
            if src is Tier.HOST:
                self.to_device.append((src_id, dst_id))
            else:
                self.loads.append((src, src_id, dst, dst_id))
        else:
            self.moves.append((src, src_id, dst, dst_id))


TierCopy = tuple[Tier, int, Tier, int]
"""One copy between tiers: (source tier, its block id, destination tier, its block id)."""


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One lower tier a KV manager stacks below the device: a backend picked by name."""

    name: str  # a name registered in ``worker.kv.tier_backend.TIER_BACKENDS``, e.g. "host"
    num_blocks: int  # capacity in blocks (0: the tier is left out)
    options: Mapping[str, Any] = field(default_factory=dict)  # backend-specific keywords


@dataclass(frozen=True, slots=True)
class TierStats:
    """One lower tier's figures (all counts in blocks unless named tokens)."""

    tier: Tier  # the tier its events carry
    num_blocks: int  # capacity
    cached_blocks: int  # blocks it holds now
    stored_blocks: int  # blocks stored into it so far (evictions from above, swap-outs, imports)
    loaded_blocks: int  # blocks loaded back to the device so far
    evicted_blocks: int  # blocks it dropped (or passed down) so far
    hit_tokens: int = 0  # prompt tokens adopted from it (loaded on adoption)
    capacity_bytes: int = 0  # byte budget of a tier that counts bytes (disk; 0: blocks only)
    usage_bytes: int = 0  # bytes it holds now (same tiers)
    written_blocks: int = 0  # blocks written durably (disk)
    read_blocks: int = 0  # blocks read back and checked (disk)
    skipped_reads: int = 0  # blocks of hits left to recompute: loading was slower (disk)
    failed_reads: int = 0  # blocks refused by a check at read time, recomputed (disk)
    dropped_writes: int = 0  # runs not written: queue full, no room, or the tier off (disk)
    enabled: bool = True  # False once a fault turned the tier off (disk: host-only then)


@dataclass(slots=True)
class ExportPin:
    """The leading run of the asked keys this worker holds, pinned for the runner's copy."""

    keys: list[BlockKey]  # the run's keys (a prefix of those asked)
    token_ids: list[tuple[int, ...]]  # their tokens
    device_ids: list[int]  # device blocks of the run's first part
    host_ids: list[int]  # host blocks of the rest (read before the next engine step)
    blocks: list[KVBlock] = field(default_factory=list)  # device blocks with a ref taken
    released: bool = False

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class ImportPlan:
    """Where the runner writes the part of a run the importer lacks (see ``plan_import``)."""

    tier: Tier  # the tier the imported blocks land in
    offset: int  # index into the run of the first block to write
    block_ids: list[int]  # destination block ids (device or host), one per written block
    keys: list[BlockKey]  # their keys
    token_ids: list[tuple[int, ...]]  # their tokens
    parent: BlockKey | None  # key before keys[0]
    tenant: str | None  # quota owner of the prompt's salt
    blocks: list[KVBlock] = field(default_factory=list)  # device destinations (ref 1 each)
    held: list[KVBlock] = field(default_factory=list)  # the prompt's device hit, pinned
    done: bool = False

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class KVStats:
    """Snapshot of the pool; all counts in blocks unless named tokens."""

    num_blocks: int  # pool size
    used_blocks: int  # blocks with ref count > 0
    free_blocks: int  # allocatable now: never-used/uncached free + evictable cached
    cached_blocks: int  # blocks holding a prefix-cache key (in use or evictable)
    evictable_cached_blocks: int  # cached blocks with ref count 0 (part of free_blocks)
    usage: float  # used_blocks / num_blocks
    num_seqs: int  # live sequences
    prefix_queried_tokens: int  # prompt tokens of admitted sequences
    prefix_hit_tokens: int  # of those, tokens served from the prefix cache
    prefix_hit_rate: float  # prefix_hit_tokens / prefix_queried_tokens (0.0 when none)
    tenant_quota_evictions: int = 0  # idle cached blocks evicted over their tenant's quota
    host_blocks: int = 0  # host tier size (0: no host tier)
    host_cached_blocks: int = 0  # blocks the host tier holds now
    host_hit_tokens: int = 0  # of prefix_hit_tokens, those loaded back from the host tier
    host_stored_blocks: int = 0  # blocks copied device -> host so far
    host_loaded_blocks: int = 0  # blocks copied host -> device so far
    host_evicted_blocks: int = 0  # blocks dropped from the host tier so far
    tiers: tuple[TierStats, ...] = ()  # every lower tier's figures, fastest first (host too)
    # sampled blocks' residency: lifetime, idle before evict, reuse gap (block_lifetimes.py)
    block_histograms: dict[str, HistogramCounts] = field(default_factory=dict)
