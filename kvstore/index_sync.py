"""IndexSync: the publisher thread's rounds against Redis: register, resync, apply the
recorded ops in numbered batches, heartbeat the load, purge dead registrations.

It owns what the thread alone touches: the worker's :class:`~kvstore.recorder.Recorder`, the
outbox of recorded ops, the batch numbers, the registration epoch and the timers. It reads
the engine's submissions from a :class:`~kvstore.publisher_inbox.PublisherInbox` and counts
into it. Each method runs in the publisher's thread and raises
:class:`~kvstore.index_types.IndexUnavailable` when Redis does not answer (the thread backs off and
retries). A stale epoch (this worker was purged or superseded) clears the epoch so the next
round registers again; a gap in the batch numbers makes the pool's snapshot replace the
buffered ops. Every ``spares_interval_s`` a round also asks which of the worker's keys another
worker keeps (:meth:`~kvstore.index.KVIndex.spare_keys`) and hands them to ``on_spares``: the
worker's pool evicts those first (fleet-aware eviction), with no Redis call per eviction.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvstore.blocks.hashing import BlockKey
from kvstore.index_types import IndexUnavailable, WorkerLoad
from kvstore.publisher_inbox import PublisherInbox
from kvstore.recorder import Op, TierKeys

if TYPE_CHECKING:
    from kvstore.index import KVIndex

Item = tuple[list[Op], int]  # ops recorded from one submit() call, number of events in it
SPARES_DUTY = 20  # a spare-keys refresh waits at least this many times its own duration


class IndexSync:
    """Syncs one worker's recorded ops and load with the index; driven by one thread."""

    def __init__(
        self,
        index: KVIndex,
        worker_id: str,
        inbox: PublisherInbox,
        list_cached_keys: Callable[[], Iterable[BlockKey] | TierKeys],
        *,
        wake: Callable[[], None],
        address: str | None = None,
        max_buffer_events: int = 100_000,
        max_batch_keys: int = 20_000,
        purge_interval_s: float | None = 10.0,
        on_spares: Callable[[set[BlockKey]], None] | None = None,
        spares_interval_s: float = 0.5,
    ) -> None:
        """``wake``: makes the thread run its next round at once (after a lost
        registration); ``list_cached_keys``: the worker's keys for a resync, safe to call
        while its engine runs (see :mod:`kvstore.publisher`)."""
        self.index = index
        self.worker_id = worker_id
        self.address = address
        self._inbox = inbox
        self._list_cached_keys = list_cached_keys
        self._wake = wake
        self._max_buffer = max_buffer_events
        self._max_batch_keys = max_batch_keys
        self._purge_interval_s = purge_interval_s
        self.heartbeat_interval_s = index.config.heartbeat_ttl_s / 4
        self._recorder = index.recorder(worker_id)
        self._outbox: deque[Item] = deque()
        self._outbox_events = 0
        self._inflight: tuple[int, list[Item]] | None = None  # (batch_seq, items) being sent
        self._resync_due = False
        self._seq = 0
        self._epoch: int | None = None
        self.sent_load: WorkerLoad | None = None  # the load Redis holds for this worker
        self._last_heartbeat = 0.0
        self._last_purge = time.monotonic()
        # fleet-aware eviction: called from this thread with the keys another worker keeps
        self._on_spares = on_spares
        self._spares_interval_s = spares_interval_s
        self._next_spares = 0.0

    @property
    def epoch(self) -> int | None:
        """Current registration epoch, None before the first successful register()."""
        return self._epoch

    def synced(self) -> bool:
        """Registered, and every recorded op is in Redis."""
        return (
            self._epoch is not None
            and not self._resync_due
            and not self._outbox
            and self._inflight is None
        )

    def want_resync(self) -> None:
        """Replace the worker's entries by a snapshot of its pool in the next round."""
        self._resync_due = True

    def deregister(self) -> None:
        """End the registration (its entries are ignored at once)."""
        if self._epoch is not None:
            self.index.deregister(self.worker_id, self._epoch)

    # -- recording ---------------------------------------------------------------------

    def drain(self) -> None:
        """Inbox -> recorder -> outbox. Runs whatever Redis's state, so positions stay right."""
        submitted, overflow = self._inbox.take()
        if overflow:
            # Events were lost before the recorder saw them. The resync's snapshot supersedes
            # everything up to now, and a remembered position may have outlived a removal it
            # missed (it could later record a key whose ancestor it does not: a hole that a
            # bisect lookup would read past), so the recorder starts afresh.
            self._inbox.count(events_dropped=sum(len(events) for events in submitted))
            submitted = []
            self._recorder.forget()
            self.drop_outbox()
        applied = 0
        for events in submitted:
            ops = self._recorder.record(events)
            if ops:
                self._outbox.append((ops, len(events)))
                self._outbox_events += len(events)
            else:
                applied += len(events)  # nothing recorded: nothing to send
        self._inbox.count(events_applied=applied)
        if self._outbox_events > self._max_buffer:
            self.drop_outbox()

    def drop_outbox(self) -> None:
        """Forget buffered ops: the next sync replaces the worker's key set from its pool."""
        self._inbox.count(events_dropped=self._outbox_events)
        self._outbox.clear()
        self._outbox_events = 0
        self._resync_due = True

    # -- rounds against Redis ----------------------------------------------------------

    def sync(self, now: float) -> None:
        """One round: register if needed, resync if due, send the outbox, and heartbeat,
        refresh the spares and purge when their time has come."""
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
        load = self._inbox.load
        self._epoch = self.index.register(self.worker_id, self.address, load)
        self.sent_load = load
        self._seq = 0
        self._inflight = None
        self._resync_due = True
        self._last_heartbeat = time.monotonic()
        self._inbox.count(registrations=1)

    def _resync(self) -> bool:
        """Send the pool's whole key set; False if the epoch went stale."""
        assert self._epoch is not None
        self._inbox.unmark()
        keys = self._list_cached_keys()
        self._supersede()
        self._seq += 1
        if not self.index.resync(self.worker_id, self._epoch, self._seq, keys):
            self._epoch = None
            return False
        self._resync_due = False
        self._inbox.count(resyncs=1)
        return True

    def _supersede(self) -> None:
        """If the snapshot was marked, drop the events it already holds: the whole outbox
        (drained before it) and the inbox up to the mark, recorded but not sent."""
        covered = self._inbox.take_covered()
        if covered is None:
            return
        for events in covered:
            self._recorder.record(events)  # positions stay current; the ops are not needed
        superseded = self._outbox_events + sum(len(events) for events in covered)
        if self._inflight is not None:
            superseded += sum(n for _, n in self._inflight[1])
        self._outbox.clear()
        self._outbox_events = 0
        self._inflight = None
        self._inbox.count(events_applied=superseded)

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
                self._inbox.count(events_dropped=sum(n for _, n in items))
                self.drop_outbox()
                self._epoch = None
                return False
            if result.needs_resync:  # gap: the pool's snapshot supersedes the buffered ops
                self._inbox.count(events_dropped=sum(n for _, n in items))
                self.drop_outbox()
                if not self._resync():
                    return False
                continue
            self._inbox.count(events_applied=sum(n for _, n in items), batches=1)
        return True

    def _take_batch(self) -> list[Item]:
        items: list[Item] = []
        keys = 0
        while self._outbox:
            size = sum(len(op.keys) for op in self._outbox[0][0])
            if items and keys + size > self._max_batch_keys:
                break
            item = self._outbox.popleft()
            self._outbox_events -= item[1]
            items.append(item)
            keys += size
        return items

    def _maybe_heartbeat(self, now: float) -> None:
        load = self._inbox.load
        since = now - self._last_heartbeat
        if since < 0.9 * self.heartbeat_interval_s and (load == self.sent_load or since < 0.05):
            return
        assert self._epoch is not None
        if not self.index.heartbeat(self.worker_id, self._epoch, load):
            self._epoch = None  # purged or superseded: the next round registers again
            self._wake()
            return
        self.sent_load = load
        self._last_heartbeat = now
        self._inbox.count(heartbeats=1)

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
        self._inbox.count(spare_refreshes=1)

    def _maybe_purge(self, now: float) -> None:
        if self._purge_interval_s is None or now - self._last_purge < self._purge_interval_s:
            return
        self._last_purge = now
        self._inbox.count(purged_workers=self.index.purge_dead(max_workers=8))
