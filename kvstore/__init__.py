"""Global KV block index on Redis: which worker holds which KV blocks, cluster-wide.

Workers publish KV events through :class:`kvstore.publisher.WorkerPublisher` (a background
thread; the engine only calls ``submit``); routers call :meth:`kvstore.index.KVIndex.lookup`
(one round trip, whatever the prompt length) and ``KVIndex.live_workers``. Every operation
is one atomic Lua script. Config: ``kvstore.config.IndexConfig``; types and errors:
``kvstore.index_types``. ``kvstore.blocks`` is the ground layer: the block vocabulary that the
index, workers and routers share (importing it loads nothing of the index).

Schema
======
All keys of one (cluster, model) start with ``kvc:{<cluster>:<model>}:`` (``<ns>`` below);
the braces are a Redis Cluster hash tag, so a model's index lives in one hash slot and the
multi-key scripts run on Redis Cluster too (scale out by model, not within one).

=====================  ======  ===========================================================
key                    type    content
=====================  ======  ===========================================================
``<ns>blk:<tier>``     hash    field: a recorded 16-byte block key (raw bytes) in that tier;
                               value: the slots holding it, 2 big-endian bytes each, sorted
``<ns>held:<tier>:<slot>``
                       set     the 16-byte keys one registration holds in that tier (resync,
                               clear, purge)
``<ns>reg``            hash    worker id -> ``"<slot>:<epoch>"``, its current registration
``<ns>slots``          hash    slot -> ``"<epoch>:<worker id>"`` for every registration not yet
                               purged (current, superseded or dead)
``<ns>seq``            hash    slot -> last applied batch sequence number
``<ns>hb:<slot>``      string  JSON ``{"a": address, "l": load}``, TTL ``heartbeat_ttl_s``
``<ns>epoch``          hash    worker id -> last epoch: max(last + 1, server time in ms)
``<ns>nslot``          string  next never-used slot number
``<ns>free``           set     purged slots ready for reuse
=====================  ======  ===========================================================

``<tier>`` is the value of a :class:`~kvstore.blocks.tiers.Tier` in
:data:`~kvstore.blocks.tiers.HELD_TIERS` (``device``, ``host``, ``disk``); the scripts list
those tiers from ``HELD_TIERS``, so a tier added there is indexed with no edit here.

A *slot* (0..65535) names one registration (worker id, epoch). Registering again gives a new
epoch and a new slot and deletes the old slot's heartbeat, so the old entries are ignored at
once: a lookup only counts slots that are some worker's current registration *and* have a
live heartbeat. Entries of dead slots stay until :meth:`KVIndex.purge_dead` walks ``slots``
(the registry, never the keyspace) and empties their ``held`` sets in bounded chunks; only
then is a slot reused, so a ``blk:<tier>`` value never names a reused slot's stale entries.

Memory (Redis 7.0, jemalloc; ``MEMORY USAGE`` and ``benchmarks/kvstore_index.py``):

* ``blk:device`` field: ~80 B per distinct recorded block (dict entry, 16-byte field, value) plus
  2 B per holder;
* ``held`` member: ~72 B per recorded (block, worker) entry;
* so one (block, worker) entry costs ~72 + 80/h B where h is the number of workers holding
  the block: 95 B measured with 1M entries over 64 workers and h = 4 (378 B per distinct
  block); ``record_every = k`` divides it by k (24 B per cached (block, worker) at k = 4).

Lookup
======
Both modes read ``reg`` and the heartbeats (one MGET); the *candidates* are the live slots
that hold the prompt's first key (every other live worker gets 0). ``IndexConfig.lookup``:

* ``bisect`` (default): from an index ``lo`` that every candidate holds, gallop (HGET
  ``lo+1, lo+2, lo+4, ..., n-1``) to a key some candidate lacks, binary-search the gap for
  the first such index ``b``, give the candidates missing at ``b`` the count ``b`` and go on
  from ``b`` with the others, until none is left. O(breakpoints x log n) HGETs, a breakpoint
  being a distinct count among the candidates: 12 probes for a 2k-block prompt held in full.
  Inside Redis 0.23/0.41 ms p50/p99 at 2k blocks (scan: 1.8/2.6 ms) and 0.61/1.03 ms with 16
  holders at 16 distinct depths, with 1M entries over 64 workers (``benchmarks/kvstore_index``).
* ``scan``: HMGET the prompt's keys in growing chunks (1, 64, 256, 1024, 1024, ...) until no
  candidate is left; a candidate's count is the index of the first key it lacks (a hole at j
  stops it at j); equal consecutive values (same holders) cost O(1). ~0.7-1 us per key read
  inside Redis, so long prompts want ``record_every > 1`` (it then reads n/k keys).

Why bisect is exact. Call ``H(i)`` the candidates holding the prompt's key i. Bisect reads
only a few keys and takes "every candidate holds key p" to mean "holds keys 0..p"; that is
exact iff ``H(0) ⊇ H(1) ⊇ ...``, which holds when every live slot's set of recorded keys is
PREFIX-CLOSED (with a key, its parent key; keys are chained, so along a prompt that is "with
block j, blocks 0..j-1"). Every writer keeps it so:

* the worker's prefix cache is prefix-closed (``worker/kv/block_pool.py``: LRU eviction drops
  children before parents, and a block computed twice by concurrent sequences is kept as a
  *twin* that serves its key when the first copy is evicted); the KV manager's property tests
  check it after every step;
* the :class:`Recorder` records a key only at a position learned from a known parent, so the
  keys it records (positions k-1, 2k-1, ...) are prefix-closed too; after events were lost
  before reaching it, it forgets its positions (``Recorder.forget``);
* APPLY replays a worker's events in order, each batch atomically; RESYNC replaces a slot's
  set by a snapshot of its (prefix-closed) cache; a clear empties it;
* PURGE_SLOT removes a *dead* slot's entries in random chunks (not prefix-closed meanwhile),
  but dead slots are never candidates, and bisect counts candidates in a value rather than
  comparing value lengths, so other slots' entries never matter;
* RESYNC snapshots are exact: the worker takes its cache's keys under the engine lock and
  marks there which submitted events they already hold (``WorkerPublisher.mark_snapshot``),
  so those are dropped rather than replayed on the newer snapshot (which could leave a child
  without its parent until later events arrived). A publisher that does not mark its
  snapshots keeps that few-millisecond window, where bisect may over-count and scan
  under-count; counts are routing hints (a worker reuses only what its own prefix match
  finds), so it would cost routing quality only.

Tiers. ``KVIndex.lookup_tiers`` returns per live worker its leading blocks per tier
(``TierBlocks``: ``{DEVICE: d, HOST: h, ...}``, the tiers holding none left out) in one script
call (``lookup_scripts.LOOKUP_TIERS``): the device lookup of the configured mode, then for each
lower tier with any entry the same walk (bisect or scan) over values naming a key's holders in
that tier or a faster one, giving the depth of each worker's prefix held in those tiers; a
tier's count is how far it extends the faster tiers' depth (h = u - d for the host tier).
Exact under the same condition, since the KV manager keeps each worker's union of tiers
prefix-closed (``worker/kv/``), so the keys past the faster tiers' depth are all in that tier.
Each lower tier without any entry costs one EXISTS. A resync passes the keys per tier
(``kvstore.recorder.TierKeys``, a mapping Tier -> keys; a tier not named is emptied); a clear
and a purge empty every tier.

Use ``scan`` when a publisher is not this engine, or its cache may hold a block without its
parent (another eviction policy, hand-written events): scan is exact for any index.

Writers: one thread per worker id (its :class:`Recorder` is not thread-safe); any number of
workers and routers may share one :class:`KVIndex`.
"""
