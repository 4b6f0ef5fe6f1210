"""A router's own view of the work it sent, newer than any heartbeat: per worker, the
prompt tokens it sent that are not yet prefilled (no token back yet) and its open streams.

Heartbeat loads lag by up to a heartbeat interval; a burst routed meanwhile would all see
idle workers and herd. Placement reads, per worker, the larger of the heartbeat's figure and
this router's own (max, not sum: the heartbeat may already include it). Written by the
decide thread (placing) and the event loop (first token, end), hence the lock; the totals
are kept as they change, so a placement's read costs O(workers), not O(requests in flight).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from kvstore.types import WorkerLoad


class SentWork:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unprefilled: dict[str, dict[str, int]] = {}  # worker -> request -> tokens
        self._unprefilled_total: Counter[str] = Counter()  # worker -> sum of the above
        self._open: Counter[str] = Counter()  # worker -> open streams
        self.idle_at_placement: set[str] = set()  # requests placed on an idle worker

    def loads(self, heartbeats: Mapping[str, WorkerLoad]) -> dict[str, WorkerLoad]:
        """The heartbeat loads with this router's own work folded in."""
        with self._lock:
            return {
                w: replace(
                    load,
                    queued_prefill_tokens=max(
                        load.queued_prefill_tokens, self._unprefilled_total[w]
                    ),
                    running=max(load.running, self._open[w]),
                )
                for w, load in heartbeats.items()
            }

    def placed(self, worker: str, request_id: str, uncached_tokens: int, *, idle: bool) -> None:
        """A request was placed on ``worker`` (``idle``: which had no work at all then)."""
        if idle:
            self.idle_at_placement.add(request_id)  # its TTFT is its prefill time
        with self._lock:
            self._open[worker] += 1
            self._unprefilled.setdefault(worker, {})[request_id] = uncached_tokens
            self._unprefilled_total[worker] += uncached_tokens

    def prefilled(self, worker: str, request_id: str, *, done: bool) -> None:
        """The request's first token came back (its prefill is done; once), or it ``done``
        (once per placement, whether or not a token came)."""
        if done:
            self.idle_at_placement.discard(request_id)
        with self._lock:
            tokens = self._unprefilled.get(worker, {}).pop(request_id, None)
            if tokens is not None:
                self._unprefilled_total[worker] -= tokens
            if done:
                self._open[worker] -= 1
