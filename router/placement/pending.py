"""The router's memory of its own recent placements (pending prefixes, short TTL).

A worker publishes a prompt's blocks only once it schedules the prompt, and the events then
take a while to reach the index. Siblings of a request (same long prefix, arriving within
that window) would see no holder and scatter. Recording each placement's keys for a few
seconds, and merging them into the index's answer, lands them together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvstore.blocks.hashing import BlockKey
from router.placement.prefix_source import leading_counts
from router.placement.types import WorkerId


class PendingPlacements:
    """key -> {worker: expiry}; entries expire ``ttl_s`` after their latest placement."""

    def __init__(self, ttl_s: float) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._expiry: dict[BlockKey, dict[WorkerId, float]] = {}
        self._queue: deque[tuple[float, WorkerId, tuple[BlockKey, ...]]] = deque()

    def record(self, worker_id: WorkerId, keys: Sequence[BlockKey], now: float) -> None:
        if self.ttl_s == 0 or not keys:
            return
        self._expire(now)
        until = now + self.ttl_s
        for key in keys:
            self._expiry.setdefault(key, {})[worker_id] = until
        self._queue.append((until, worker_id, tuple(keys)))

    def lookup(self, keys: Sequence[BlockKey], now: float) -> dict[WorkerId, int]:
        """Leading blocks of ``keys`` that each worker was recently sent (unexpired)."""
        self._expire(now)
        if not self._expiry:
            return {}
        return leading_counts(keys, self._expiry.get)

    def __len__(self) -> int:
        return len(self._expiry)

    def _expire(self, now: float) -> None:
        # The queue is in expiry order (constant TTL, non-decreasing clock): O(expired keys).
        while self._queue and self._queue[0][0] <= now:
            until, worker_id, keys = self._queue.popleft()
            for key in keys:
                holders = self._expiry.get(key)
                if holders is not None and holders.get(worker_id) == until:
                    del holders[worker_id]  # not refreshed by a later placement
                    if not holders:
                        del self._expiry[key]
