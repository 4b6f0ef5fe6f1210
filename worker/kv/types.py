"""Ids, result types and errors passed between the KV manager and its callers."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NewType

from kvstore.blocks.hashing import BlockKey, HashContext

BlockId = NewType("BlockId", int)
"""Index of a physical KV block in the pool (and in the model runner's KV tensors)."""

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
    keys: tuple[BlockKey, ...]  # chained keys of the whole hit: device blocks, then host ones
    num_tokens: int  # tokens covered = len(keys) * block_size; <= len(prompt) - 1
    ctx: HashContext | None = None  # context the keys were computed with (checked on adoption)
    num_host_tokens: int = 0  # of num_tokens, those in the host tier (loaded on adoption)

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


@dataclass(slots=True)
class TierTransfers:
    """Copies between the device and host tiers the model runner must make, in this order,
    before the step's copy-on-write copies and forward pass (see ``KVCacheManager``)."""

    to_host: list[tuple[int, int]] = field(default_factory=list)  # (device, host): offloads
    to_device: list[tuple[int, int]] = field(default_factory=list)  # (host, device): loads

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device)


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
