"""Answers that callers ask for in floods (``/health``, ``/metrics``, ``/v1/models``, the
gRPC ``ClusterStatus``): each is computed at most once per reuse window, and the callers
that arrive while it is computed share that one computation.

What they read (the fleet: Ray's name listing, the index, a call to every worker) costs far
more than the answer, and some of them are open to unauthenticated callers: a flood of them
costs a few computations a second, not one per call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

MAX_KEYS = 1024  # cached answers (e.g. one per tenant and route); beyond, the cache starts over


class AnswerCache:
    """Answers by key, each computed at most once per ``ttl_s``; callers that arrive while
    one is computed await it (shielded: one caller leaving does not cancel it for the
    others). An error is not cached: the next caller computes again."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._done: dict[Hashable, tuple[float, Any]] = {}
        self._running: dict[Hashable, asyncio.Future] = {}

    async def get(self, key: Hashable, make: Callable[[], Awaitable[Any]]) -> Any:
        hit = self._done.get(key)
        if hit is not None and self.clock() - hit[0] < self.ttl_s:
            return hit[1]
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(self._make(key, make))
        return await asyncio.shield(running)

    def forget(self) -> None:
        """Drop the answers kept (what they answer changed); one being computed is kept
        when it ends (it read the change or raced it, as any answer within ``ttl_s``)."""
        self._done.clear()

    async def _make(self, key: Hashable, make: Callable[[], Awaitable[Any]]) -> Any:
        try:
            value = await make()
            if len(self._done) >= MAX_KEYS:
                self._done.clear()
            self._done[key] = (self.clock(), value)
            return value
        finally:
            del self._running[key]
