"""The publisher thread's rounds against Redis: register, resync, apply the outbox in
numbered batches, heartbeat the load, purge dead registrations.

:class:`IndexSync` is mixed into :class:`~kvstore.publisher.WorkerPublisher`, which owns the
state named below and fills the outbox; each method here runs in the publisher's thread and
raises :class:`~kvstore.types.IndexUnavailable` when Redis does not answer (the thread backs
off and retries). A stale epoch (this worker was purged or superseded) clears the epoch so the
next round registers again; a gap in the batch numbers makes the pool's snapshot replace the
buffered ops. Every ``spares_interval_s`` a round also asks which of the worker's keys another
worker keeps (:meth:`~kvstore.index.KVIndex.spare_keys`) and hands them to ``on_spares``: the
worker's pool evicts those first (fleet-aware eviction), with no Redis call per eviction.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.blocks.hashing import BlockKey
from kvstore.events import Op, Recorder, TierKeys
from kvstore.types import IndexUnavailable, WorkerLoad

if TYPE_CHECKING:
    from kvstore.index import KVIndex

Item = tuple[list[Op], int]  # ops recorded from one submit() call, number of events in it
SPARES_DUTY = 20  # a spare-keys refresh waits at least this many times its own duration


class IndexSync:
    """Syncing the buffered ops and the load with the index (state set up by
    ``WorkerPublisher.__init__``; the fields under ``_lock`` are shared with ``submit``)."""

    index: KVIndex
    worker_id: str
    address: str | None
    _list_cached_keys: Callable[[], Sequence[BlockKey] | TierKeys]
    _max_batch_keys: int
    _purge_interval_s: float | None
    _heartbeat_interval_s: float
    _recorder: Recorder
    _lock: threading.Lock
    _inbox: list[tuple[int, Sequence[object]]]  # (submit number, events), under _lock
    _inbox_events: int  # under _lock
    _cut: int | None  # submits covered by the snapshot being taken, under _lock
    _load: WorkerLoad  # the latest submitted load, under _lock
    _wake: threading.Event
    _resync_asked: threading.Event
    _outbox: deque[Item]
    _outbox_events: int
    _inflight: tuple[int, list[Item]] | None  # (batch_seq, items) being sent
    _resync_due: bool
    _seq: int
    _epoch: int | None
    _sent_load: WorkerLoad | None
    _last_heartbeat: float
    _last_purge: float
    _on_spares: Callable[[set[BlockKey]], None] | None
    _spares_interval_s: float
    _next_spares: float

    if TYPE_CHECKING:  # WorkerPublisher's

        def _count(self, **increments: int) -> None: ...

        def _drop_outbox(self) -> None: ...

    def _sync(self, now: float) -> None:
        if self._resync_asked.is_set():
            self._resync_asked.clear()
            self._resync_due = True
        for _ in range(3):  # a registration lost meanwhile restarts the round (bounded)
            if self._epoch is None:
                self._register()
            if self._resync_due and not self._resync():
                continue
            if self._apply_outbox():
                break
        if self._epoch is None:  # superseded three times in a row: back off and retry
            raise IndexUnavailable(f"registration of {self.worker_id!r} keeps being superseded")
        self._maybe_heartbeat(now)
        self._maybe_spares(now)
        self._maybe_purge(now)

    def _register(self) -> None:
        load = self._current_load()
        self._epoch = self.index.register(self.worker_id, self.address, load)
        self._sent_load = load
        self._seq = 0
        self._inflight = None
        self._resync_due = True
        self._last_heartbeat = time.monotonic()
        self._count(registrations=1)

    def _resync(self) -> bool:
        """Send the pool's whole key set; False if the epoch went stale."""
        assert self._epoch is not None
        with self._lock:
            self._cut = None
        keys = self._list_cached_keys()
        self._supersede()
        self._seq += 1
        if not self.index.resync(self.worker_id, self._epoch, self._seq, keys):
            self._epoch = None
            return False
        self._resync_due = False
        self._count(resyncs=1)
        return True

    def _supersede(self) -> None:
        """If the snapshot was marked, drop the events it already holds: the whole outbox
        (drained before it) and the inbox up to the mark, recorded but not sent."""
        with self._lock:
            cut, self._cut = self._cut, None
            if cut is None:
                return
            covered = [events for n, events in self._inbox if n <= cut]
            self._inbox = [(n, events) for n, events in self._inbox if n > cut]
            self._inbox_events = sum(len(events) for _, events in self._inbox)
        for events in covered:
            self._recorder.record(events)  # positions stay current; the ops are not needed
        superseded = self._outbox_events + sum(len(events) for events in covered)
        if self._inflight is not None:
            superseded += sum(n for _, n in self._inflight[1])
        self._outbox.clear()
        self._outbox_events = 0
        self._inflight = None
        self._count(events_applied=superseded)

    def _apply_outbox(self) -> bool:
        """Send the outbox in batches; False if the epoch went stale (register again)."""
        assert self._epoch is not None
        while self._inflight is not None or self._outbox:
            if self._inflight is None:  # a batch keeps its seq across retries (dedup)
                self._seq += 1
                self._inflight = (self._seq, self._take_batch())
            seq, items = self._inflight
            ops = [op for item_ops, _ in items for op in item_ops]
            result = self.index.apply_ops(self.worker_id, self._epoch, seq, ops)
            self._inflight = None
            if result.stale_epoch:
                self._count(events_dropped=sum(n for _, n in items))
                self._drop_outbox()
                self._epoch = None
                return False
            if result.needs_resync:  # gap: the pool's snapshot supersedes the buffered ops
                self._count(events_dropped=sum(n for _, n in items))
                self._drop_outbox()
                if not self._resync():
                    return False
                continue
            self._count(events_applied=sum(n for _, n in items), batches=1)
        return True

    def _take_batch(self) -> list[Item]:
        items: list[Item] = []
        keys = 0
        while self._outbox:
            size = sum(len(op[1]) for op in self._outbox[0][0])
            if items and keys + size > self._max_batch_keys:
                break
            item = self._outbox.popleft()
            self._outbox_events -= item[1]
            items.append(item)
            keys += size
        return items

    def _current_load(self) -> WorkerLoad:
        with self._lock:
            return self._load

    def _maybe_heartbeat(self, now: float) -> None:
        load = self._current_load()
        since = now - self._last_heartbeat
        if since < 0.9 * self._heartbeat_interval_s and (load == self._sent_load or since < 0.05):
            return
        assert self._epoch is not None
        if not self.index.heartbeat(self.worker_id, self._epoch, load):
            self._epoch = None  # purged or superseded: the next round registers again
            self._wake.set()
            return
        self._sent_load = load
        self._last_heartbeat = now
        self._count(heartbeats=1)

    def _maybe_spares(self, now: float) -> None:
        """Pass the keys another worker keeps to ``on_spares`` (after the outbox went out, so
        the index names what this worker holds now, give or take a step). The call is
        O(this worker's keys) in Redis: it runs every ``spares_interval_s``, or 20 times its
        own duration when that is longer, so it takes at most 5 % of Redis's time per
        worker, whatever the pool's size."""
        if self._on_spares is None or now < self._next_spares:
            return
        assert self._epoch is not None
        t0 = time.monotonic()
        spares = self.index.spare_keys(self.worker_id, self._epoch)
        took = time.monotonic() - t0
        self._next_spares = now + max(self._spares_interval_s, SPARES_DUTY * took)
        self._on_spares(spares)
        self._count(spare_refreshes=1)

    def _maybe_purge(self, now: float) -> None:
        if self._purge_interval_s is None or now - self._last_purge < self._purge_interval_s:
            return
        self._last_purge = now
        self._count(purged_workers=self.index.purge_dead(max_workers=8))
