"""WorkerPublisher: ships a worker's KV events and load to the index from a background thread.

The engine's step loop only calls :meth:`WorkerPublisher.submit`, which appends to an inbox
(:class:`~kvstore.publisher_inbox.PublisherInbox`) under a lock held for O(1) and never
touches Redis. The publisher owns the thread and its backoff; the thread's rounds against
Redis are an :class:`~kvstore.index_sync.IndexSync`'s. The thread:

1. drains the inbox through the worker's :class:`~kvstore.recorder.Recorder` into an outbox
   of ops (always, even during an outage, so recorded positions stay right);
2. registers if it has no epoch, resyncs if needed, applies the outbox in batches (one round
   trip each, numbered 1, 2, ...), heartbeats every ``heartbeat_ttl_s / 4`` and soon after
   the load changes, and now and then purges dead registrations;
3. on :class:`IndexUnavailable` keeps the outbox (bounded by ``max_buffer_events``; on
   overflow it drops it and marks a resync; if ``submit`` itself overflowed, events were lost
   before the recorder saw them, so it also forgets its positions, see ``Recorder.forget``)
   and retries with backoff. When Redis answers again, a lost registration (Redis restarted
   empty, or this worker was purged) is replaced by a new epoch, and a resync from
   ``list_cached_keys()`` restores the worker's entries.

``list_cached_keys`` is called from the publisher thread; it must be safe to call while the
engine runs (e.g. take the engine's lock or read a snapshot). Events submitted after the
snapshot are applied on top of it, so the index converges to the pool's state.

If ``list_cached_keys`` also calls :meth:`WorkerPublisher.mark_snapshot` while ``submit``
cannot run (the worker does both under its engine lock), the resync is exact from the first
moment: every event submitted before that mark is already in the snapshot, so those events
(inbox and outbox) are dropped instead of replayed on top of it (the recorder still sees them,
to keep its positions). Without the mark, old events replayed on the newer snapshot can leave
a slot with a hole for a few milliseconds (a removed parent whose re-stored child the
snapshot holds), until the events that follow them arrive.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvstore.blocks.hashing import BlockKey
from kvstore.index import KVIndex
from kvstore.index_sync import IndexSync
from kvstore.index_types import IndexUnavailable, PublisherStats, WorkerLoad
from kvstore.publisher_inbox import PublisherInbox
from kvstore.recorder import TierKeys

_log = logging.getLogger(__name__)


class WorkerPublisher:
    """Publishes one worker's KV events and load; see the module docstring."""

    def __init__(
        self,
        index: KVIndex,
        worker_id: str,
        list_cached_keys: Callable[[], Iterable[BlockKey] | TierKeys],
        *,
        address: str | None = None,
        max_buffer_events: int = 100_000,
        max_batch_keys: int = 20_000,
        purge_interval_s: float | None = 10.0,
        max_backoff_s: float = 1.0,
        on_spares: Callable[[set[BlockKey]], None] | None = None,
        spares_interval_s: float = 0.5,
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._resync_asked = threading.Event()  # request_resync() was called
        self.inbox = PublisherInbox(max_buffer_events)
        self.sync = IndexSync(
            index,
            worker_id,
            self.inbox,
            list_cached_keys,
            wake=self._wake.set,
            address=address,
            max_buffer_events=max_buffer_events,
            max_batch_keys=max_batch_keys,
            purge_interval_s=purge_interval_s,
            on_spares=on_spares,
            spares_interval_s=spares_interval_s,
        )
        self._max_backoff_s = max_backoff_s
        self._retry_at = 0.0
        self._backoff_s = 0.05
        self._healthy = False
        self._thread: threading.Thread | None = None

    # -- called by the engine ----------------------------------------------------------

    def submit(self, events: Sequence[object], load: WorkerLoad) -> None:
        """Queue a step's events and current load. Never waits on Redis."""
        self.inbox.submit(events, load)
        self._wake.set()

    def request_resync(self) -> None:
        """Replace this worker's entries with a fresh snapshot of its pool soon (any thread):
        for entries found wrong from outside (e.g. a router's predictions keep missing)."""
        self._resync_asked.set()
        self._wake.set()

    def mark_snapshot(self) -> None:
        """Called by ``list_cached_keys`` at the moment of its snapshot, where no ``submit``
        can run concurrently: every event submitted so far is in the snapshot (see the module
        docstring)."""
        self.inbox.mark()

    @property
    def epoch(self) -> int | None:
        """Current registration epoch, None before the first successful register()."""
        return self.sync.epoch

    @property
    def healthy(self) -> bool:
        """True when the last attempt to reach Redis succeeded."""
        return self._healthy

    @property
    def stats(self) -> PublisherStats:
        """A copy of the counters."""
        return self.inbox.stats

    def start(self) -> None:
        assert self._thread is None, "start() called twice"
        self._thread = threading.Thread(
            target=self._run, name=f"kv-publisher-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def stop(self, *, deregister: bool = True, timeout_s: float = 2.0) -> None:
        """Try a last flush, end the thread and deregister (entries ignored at once)."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self._thread = None
        if deregister:
            with contextlib.suppress(IndexUnavailable):
                self.sync.deregister()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything submitted so far (events and load) is in Redis; False on
        timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pending = self.inbox.pending(self.sync.sent_load)
            if not pending and self._healthy and self.sync.synced():
                return True
            self._wake.set()
            time.sleep(0.005)
        return False

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            now = time.monotonic()
            if now >= self._retry_at or stopping:
                try:
                    self.sync.drain()
                    if self._resync_asked.is_set():
                        self._resync_asked.clear()
                        self.sync.want_resync()
                    self.sync.sync(now)
                    self._healthy = True
                    self._backoff_s = 0.05
                except IndexUnavailable as exc:
                    self._failed(exc)
                except Exception as exc:  # a bug or a bad event must not kill the publisher
                    _log.exception("kv publisher %s: unexpected error", self.worker_id)
                    self.sync.drop_outbox()
                    self._failed(exc)
            else:
                self.sync.drain()  # keep recorded positions current during an outage
            if stopping:
                return
            wait = self.sync.heartbeat_interval_s
            if not self._healthy:
                wait = max(0.0, self._retry_at - time.monotonic())
            self._wake.wait(wait)
            self._wake.clear()

    def _failed(self, exc: Exception) -> None:
        if self._healthy:
            _log.warning("kv publisher %s: index unavailable (%s); buffering", self.worker_id, exc)
        self._healthy = False
        self.inbox.count(errors=1)
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
