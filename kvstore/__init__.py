"""Global KV block index on Redis: which worker holds which KV blocks, cluster-wide.

Workers publish KV events through :class:`WorkerPublisher` (a background thread; the engine
only calls ``submit``); routers call :meth:`KVIndex.lookup` (one round trip, whatever the
prompt length) and :meth:`KVIndex.live_workers`, or their coroutine twins on
:class:`AsyncKVIndex` from asyncio code. Every operation is one atomic Lua script.

Schema
======
All keys of one (cluster, model) start with ``kvc:{<cluster>:<model>}:`` (``<ns>`` below);
the braces are a Redis Cluster hash tag, so a model's index lives in one hash slot and the
multi-key scripts run on Redis Cluster too (scale out by model, not within one).

=====================  ======  ===========================================================
key                    type    content
=====================  ======  ===========================================================
``<ns>blk``            hash    field: a recorded 16-byte block key (raw bytes);
                               value: the slots holding it, 2 big-endian bytes each, sorted
``<ns>held:<slot>``    set     the 16-byte keys one registration holds (resync, clear, purge)
``<ns>reg``            hash    worker id -> ``"<slot>:<epoch>"``, its current registration
``<ns>slots``          hash    slot -> ``"<epoch>:<worker id>"`` for every registration not yet
                               purged (current, superseded or dead)
``<ns>seq``            hash    slot -> last applied batch sequence number
``<ns>hb:<slot>``      string  JSON ``{"a": address, "l": load}``, TTL ``heartbeat_ttl_s``
``<ns>epoch``          hash    worker id -> last epoch: max(last + 1, server time in ms)
``<ns>nslot``          string  next never-used slot number
``<ns>free``           set     purged slots ready for reuse
=====================  ======  ===========================================================

A *slot* (0..65535) names one registration (worker id, epoch). Registering again gives a new
epoch and a new slot and deletes the old slot's heartbeat, so the old entries are ignored at
once: a lookup only counts slots that are some worker's current registration *and* have a
live heartbeat. Entries of dead slots stay until :meth:`KVIndex.purge_dead` walks ``slots``
(the registry, never the keyspace) and empties their ``held`` sets in bounded chunks; only
then is a slot reused, so a ``blk`` value never names a reused slot's stale entries.

Memory (Redis 7.0, jemalloc; ``MEMORY USAGE`` and ``benchmarks/kvstore_index.py``):

* ``blk`` field: ~80 B per distinct recorded block (dict entry, 16-byte field, value) plus
  2 B per holder;
* ``held`` member: ~72 B per recorded (block, worker) entry;
* so one (block, worker) entry costs ~72 + 80/h B where h is the number of workers holding
  the block: 95 B measured with 1M entries over 64 workers and h = 4 (378 B per distinct
  block); ``record_every = k`` divides it by k (24 B per cached (block, worker) at k = 4).

Lookup reads ``reg`` and the heartbeats (one MGET), then HMGETs the prompt's keys in growing
chunks (1, 64, 256, 1024, 1024, ...) and stops at the first block no live candidate holds;
equal consecutive values (same holders) cost O(1). A hole at block j stops that worker's
count at j. Cost inside Redis is ~0.5-1 us per recorded key scanned, so long prompts want
``record_every > 1`` (the lookup then scans n/k keys).

Writers: one thread per worker id (its :class:`Recorder` is not thread-safe); any number of
workers and routers may share one :class:`KVIndex`.
"""

from kvstore.aio import AsyncKVIndex
from kvstore.config import IndexConfig
from kvstore.events import Op, Recorder
from kvstore.index import KVIndex
from kvstore.publisher import WorkerPublisher
from kvstore.types import (
    ApplyResult,
    IndexFull,
    IndexUnavailable,
    PublisherStats,
    WorkerInfo,
    WorkerLoad,
)

__all__ = [
    "ApplyResult",
    "AsyncKVIndex",
    "IndexConfig",
    "IndexFull",
    "IndexUnavailable",
    "KVIndex",
    "Op",
    "PublisherStats",
    "Recorder",
    "WorkerInfo",
    "WorkerLoad",
    "WorkerPublisher",
]
