"""The router's memory of its own recent placements (pending prefixes, short TTL).

A worker publishes a prompt's blocks only once it schedules the prompt, and the events then
take a while to reach the index. Siblings of a request (same long prefix, arriving within
that window) would see no holder and scatter. Recording each placement's keys for a few
seconds, and merging them into the index's answer, lands them together.

A placement whose prefill is done (its first token came back) is *settled*: its blocks are
stored and their events reach the index within a step, so the index knows the truth from
then on and the placement's claim ends ``settle_s`` later instead of at its TTL. Otherwise a
claim outlives the blocks it stands for — a worker that evicted a prefix a second after
computing it would still look like its holder for the rest of the TTL, and the pull planner
would send its siblings there to recompute instead of pulling from a real holder.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence

from kvstore.blocks.hashing import BlockKey
from router.placement.placement_types import WorkerId
from router.placement.prefix_source import leading_counts

Ticket = int  # one placement, as returned by ``record`` (``settle`` takes it)


class PendingPlacements:
    """key -> {worker: expiry}; a claim expires ``ttl_s`` after its latest placement, or
    ``settle_s`` after the last of its placements in flight settled."""

    def __init__(self, ttl_s: float, settle_s: float | None = None) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.settle_s = ttl_s if settle_s is None else min(settle_s, ttl_s)
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s}")
        self._expiry: dict[BlockKey, dict[WorkerId, float]] = {}
        # (expiry, ticket, worker, keys): placements' TTLs and settled claims' ends, soonest
        # first (settling shortens a claim, so expiries are not in placement order)
        self._heap: list[tuple[float, Ticket, WorkerId, tuple[BlockKey, ...]]] = []
        self._unsettled: dict[Ticket, tuple[WorkerId, tuple[BlockKey, ...]]] = {}
        self._in_flight: Counter[tuple[WorkerId, BlockKey]] = Counter()  # unsettled per claim
        self._tickets = itertools.count(1)

    def record(self, worker_id: WorkerId, keys: Sequence[BlockKey], now: float) -> Ticket | None:
        """Claim ``keys`` for ``worker_id``; the ticket settles it (None: nothing recorded)."""
        if self.ttl_s == 0 or not keys:
            return None
        self._expire(now)
        until = now + self.ttl_s
        ticket = next(self._tickets)
        keys = tuple(keys)
        for key in keys:
            self._expiry.setdefault(key, {})[worker_id] = until
            self._in_flight[worker_id, key] += 1
        self._unsettled[ticket] = (worker_id, keys)
        heapq.heappush(self._heap, (until, ticket, worker_id, keys))
        return ticket

    def settle(self, ticket: Ticket | None, now: float) -> None:
        """The placement's prefill is done (or it ended without one): each of its claims that
        no other placement in flight keeps ends ``settle_s`` from ``now``. A ticket already
        expired or settled is ignored."""
        entry = self._unsettled.pop(ticket, None) if ticket is not None else None
        if entry is None:
            return
        worker_id, keys = entry
        until = now + self.settle_s
        for key in self._release(worker_id, keys):
            holders = self._expiry.get(key)
            if holders is not None and worker_id in holders:
                holders[worker_id] = min(holders[worker_id], until)
        heapq.heappush(self._heap, (until, ticket, worker_id, keys))
        self._expire(now)

    def lookup(self, keys: Sequence[BlockKey], now: float) -> dict[WorkerId, int]:
        """Leading blocks of ``keys`` that each worker was recently sent (unexpired)."""
        self._expire(now)
        if not self._expiry:
            return {}
        return leading_counts(keys, self._expiry.get)

    def __len__(self) -> int:
        return len(self._expiry)

    def keys(self) -> list[BlockKey]:
        """The block keys with a placement pending (expired ones may linger until the next
        lookup or record)."""
        return list(self._expiry)

    def _release(self, worker_id: WorkerId, keys: tuple[BlockKey, ...]) -> list[BlockKey]:
        """One placement fewer in flight on each key; the keys that have none left."""
        free = []
        for key in keys:
            n = self._in_flight[worker_id, key] - 1
            if n > 0:
                self._in_flight[worker_id, key] = n
            else:
                del self._in_flight[worker_id, key]
                free.append(key)
        return free

    def _expire(self, now: float) -> None:
        # O(log n) per expired entry; an entry whose expiry no longer matches its claim (a
        # later placement refreshed it, or settling shortened it) leaves the claim alone
        while self._heap and self._heap[0][0] <= now:
            until, ticket, worker_id, keys = heapq.heappop(self._heap)
            if self._unsettled.pop(ticket, None) is not None:  # its TTL ran out unsettled
                self._release(worker_id, keys)
            for key in keys:
                holders = self._expiry.get(key)
                if holders is not None and holders.get(worker_id) == until:
                    del holders[worker_id]
                    if not holders:
                        del self._expiry[key]
