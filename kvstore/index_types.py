"""Result and value types of the index, and its typed errors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvstore.blocks.tiers import Tier


class IndexUnavailable(Exception):
    """Redis could not be reached or did not answer in time; the index state is unknown.

    Routers fall back to load-only placement; workers buffer and resync later.
    """


class IndexFull(Exception):
    """All 65,536 registration slots are taken by live or not yet purged registrations."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker reports with each heartbeat."""

    running: int  # sequences in the running batch
    waiting: int  # sequences admitted but waiting for KV blocks or a prefill slot
    free_blocks: int  # KV blocks free (or evictable) right now
    total_blocks: int  # KV blocks in the pool
    queued_prefill_tokens: int  # prompt tokens still to prefill over all queued sequences
    decode_tokens: int = 0  # tokens decoded per step by the running batch
    lora_ids: tuple[str, ...] = ()  # stable ids (``name@digest``) of the LoRA adapters served
    lora_loaded: tuple[str, ...] = ()  # of those, the ones in a device slot now
    # "adapter_id=tenant" for each tenant an adapter is registered for; an adapter without
    # any serves every tenant (ids never hold "=", tenant names may)
    lora_owners: tuple[str, ...] = ()
    # size in blocks of each KV tier below the device (a tier not named: none, so the index
    # holds no entry of it in that tier; a router then asks for device counts only)
    tier_blocks: dict[Tier, int] = field(default_factory=dict)
    # of free_blocks, the evictable cached blocks the waiting requests' prefixes will pin
    # when they start (a block several of them share counted once): room that is not free
    waiting_pinned_blocks: int = 0
    # its engine admits the waiting requests whose prefix is cached first (cache-aware
    # admission), so a request arriving with its prefix cached (pulled) runs before the
    # queue's uncached prompts allocate their blocks
    admits_cached_first: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerLoad:
        return cls(**{name: _PARSE[name](data[name]) for name in _PARSE if name in data})


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(map(str, value))


def _tier_blocks(value: Any) -> dict[Tier, int]:
    return {Tier.parse(name): int(n) for name, n in value.items()}


_PARSE: dict[str, Any] = dict.fromkeys(WorkerLoad.__dataclass_fields__, int)
_PARSE |= dict.fromkeys(("lora_ids", "lora_loaded", "lora_owners"), _strings)
_PARSE |= {"tier_blocks": _tier_blocks, "admits_cached_first": bool}


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A live registration as the router sees it."""

    worker_id: str  # stable name of the worker (e.g. its Ray actor name)
    epoch: int  # registration number; a restart gets a larger one
    load: WorkerLoad  # load from the latest heartbeat
    address: str | None  # how to reach the worker, if it published one


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """Outcome of one batch of KV events."""

    applied: bool  # the batch changed the index (False for duplicates and rejected batches)
    needs_resync: bool  # the caller must resync its whole key set before the next batch
    stale_epoch: bool = False  # the epoch was superseded or purged: register again first
    duplicate: bool = False  # batch_seq was already applied (a retry): nothing to do
    added: int = 0  # (block, worker) entries added
    removed: int = 0  # (block, worker) entries removed


@dataclass(slots=True)
class PublisherStats:
    """Counters of a :class:`~kvstore.publisher.WorkerPublisher` (a copy is handed out)."""

    events_submitted: int = 0  # KV events passed to submit()
    events_applied: int = 0  # KV events whose batch Redis accepted
    events_dropped: int = 0  # KV events dropped by a full buffer or superseded by a resync
    batches: int = 0  # apply round trips that succeeded
    resyncs: int = 0  # full key-set resyncs sent
    registrations: int = 0  # register() calls that succeeded (first start included)
    heartbeats: int = 0  # heartbeats accepted
    errors: int = 0  # IndexUnavailable seen by the background thread
    purged_workers: int = 0  # dead registrations this publisher purged
    spare_refreshes: int = 0  # sets of keys another worker keeps, handed to on_spares
