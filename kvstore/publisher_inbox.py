"""PublisherInbox: what a worker's engine hands its index publisher, and the counters both
sides keep, under one lock held O(1) (see :mod:`kvstore.publisher`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from kvstore.index_types import PublisherStats, WorkerLoad

IDLE = WorkerLoad(running=0, waiting=0, free_blocks=0, total_blocks=0, queued_prefill_tokens=0)


class PublisherInbox:
    """The events and load submitted by the engine, waiting for the publisher thread; the
    mark of a resync snapshot; the publisher's counters. Every method may run in any thread
    and holds the lock for O(1) (or O(submits waiting), taken out by the thread)."""

    def __init__(self, max_events: int) -> None:
        self._max_events = max_events
        self._lock = threading.Lock()
        self._entries: list[tuple[int, Sequence[object]]] = []  # (submit number, events)
        self._events = 0  # events in _entries
        self._submits = 0  # submit() calls so far
        self._cut: int | None = None  # submits covered by the snapshot being taken
        self._overflow = False  # events were refused since the thread last took them
        self._load = IDLE
        self._stats = PublisherStats()

    def submit(self, events: Sequence[object], load: WorkerLoad) -> None:
        """A step's events and the load after it; events over ``max_events`` waiting are
        dropped (counted) and flag an overflow."""
        with self._lock:
            self._load = load
            self._submits += 1
            self._stats.events_submitted += len(events)
            if events:
                if self._events + len(events) > self._max_events:
                    self._stats.events_dropped += len(events)
                    self._overflow = True
                else:
                    self._entries.append((self._submits, events))
                    self._events += len(events)

    def take(self) -> tuple[list[Sequence[object]], bool]:
        """Every waiting submit's events, in order, and whether some were dropped since the
        last take (then the caller must not trust what it recorded before)."""
        with self._lock:
            taken = [events for _, events in self._entries]
            self._entries, self._events = [], 0
            overflow, self._overflow = self._overflow, False
        return taken, overflow

    def mark(self) -> None:
        """A snapshot of the worker's keys is being taken now, where no submit can run: every
        event submitted so far is in it."""
        with self._lock:
            self._cut = self._submits

    def unmark(self) -> None:
        """Forget the mark (a new snapshot is about to be taken)."""
        with self._lock:
            self._cut = None

    def take_covered(self) -> list[Sequence[object]] | None:
        """The waiting events the marked snapshot already holds, taken out (None: no mark).
        Clears the mark."""
        with self._lock:
            cut, self._cut = self._cut, None
            if cut is None:
                return None
            covered = [events for n, events in self._entries if n <= cut]
            self._entries = [(n, events) for n, events in self._entries if n > cut]
            self._events = sum(len(events) for _, events in self._entries)
        return covered

    @property
    def load(self) -> WorkerLoad:
        """The latest submitted load."""
        with self._lock:
            return self._load

    def pending(self, sent_load: WorkerLoad | None) -> bool:
        """Events wait, some were dropped, or the latest load is not ``sent_load``."""
        with self._lock:
            return bool(self._entries) or self._overflow or self._load != sent_load

    def count(self, **increments: int) -> None:
        """Add to the named counters of :class:`PublisherStats`."""
        with self._lock:
            for name, n in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    @property
    def stats(self) -> PublisherStats:
        """A copy of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)
