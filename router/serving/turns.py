"""Bounding the work one router loop iteration runs when a burst of requests reaches the
same step at once (256 submits serialised to Ray in one iteration: tens of ms).

:class:`TurnSlices` lets at most ``size`` callers through per loop iteration; the rest wait
a turn (a cheap re-queue) and go on in arrival order, so a probe, a heartbeat or another
stream's write runs between two slices, as :func:`channels.demultiplex` does for wake-ups.
"""

from __future__ import annotations

import asyncio


class TurnSlices:
    """At most ``size`` callers of :meth:`enter` pass per loop iteration."""

    def __init__(self, size: int) -> None:
        assert size > 0
        self.size = size
        self._passed = 0  # callers passed in this iteration
        self._armed = False  # the reset for the next iteration is scheduled
        self.deferred = 0  # turns waited, all callers together

    async def enter(self) -> None:
        while self._passed >= self.size:
            self.deferred += 1
            await asyncio.sleep(0)  # resumes next iteration, after the reset queued before
        self._passed += 1
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._reset)

    def _reset(self) -> None:
        self._passed = 0
        self._armed = False
