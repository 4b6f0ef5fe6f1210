"""Bounding the work one router loop iteration runs when a burst of requests reaches the
same step at once (256 submits serialised to Ray in one iteration: tens of ms).

:class:`IterationSlices` lets at most ``size`` callers through per loop iteration; the rest wait
in arrival order and are let through a slice per iteration, so a probe, a heartbeat or
another stream's write runs between two slices, as
:func:`~router.serving.worker_channel.demultiplex` does for wake-ups. A waiting caller costs
nothing per iteration (one future, woken once), so a burst of n costs O(n), not a re-queue
per waiter per iteration.
"""

from __future__ import annotations

import asyncio
from collections import deque


class IterationSlices:
    """At most ``size`` callers of :meth:`enter` pass per loop iteration."""

    def __init__(self, size: int) -> None:
        assert size > 0
        self.size = size
        self._passed = 0  # callers let through in this iteration
        self._armed = False  # the next iteration's slice is scheduled
        self._waiters: deque[asyncio.Future] = deque()  # callers not let through yet
        self.deferred = 0  # callers that waited for a later iteration

    async def enter(self) -> None:
        if self._passed < self.size and not self._waiters:
            self._passed += 1
            self._arm()
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.deferred += 1
        self._arm()
        await fut  # let through (and counted) by a later iteration's slice

    def _arm(self) -> None:
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._next_slice)

    def _next_slice(self) -> None:
        """A new iteration: the next ``size`` waiters go (they run on the one after it,
        ahead of any newcomer, who waits behind them)."""
        self._armed = False
        self._passed = 0
        while self._waiters and self._passed < self.size:
            fut = self._waiters.popleft()
            if not fut.done():  # (a caller that left is skipped)
                fut.set_result(None)
                self._passed += 1
        if self._waiters or self._passed:
            self._arm()
