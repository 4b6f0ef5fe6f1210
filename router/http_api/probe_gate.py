"""The cheap routes' two bounds: cached answers, and a share of the router they may take.

``/health``, ``/version``, ``/v1/models``, ``/metrics`` (and any wrong path or method) carry
no work of the client's, so a probe or a script polling them in a loop costs the router for
nothing: on a small machine a ``/health`` flood took most of the event loop that streams
tokens. Each answer that reads
the fleet (live workers, adapters) is computed once per :data:`ANSWER_TTL_S` and shared by the
callers in between (:class:`~router.serving.answer_cache.AnswerCache`); and every cheap request
passes a :class:`ProbeGate`: a token bucket of ``rate_per_s`` (its burst the same) whose excess
waits its turn, without CPU, up to ``max_waiting`` requests; past those it is answered 503
``server_busy`` with ``Retry-After`` at once. A closed-loop poller is slowed to the rate, not
refused; generation never passes the gate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from router.serving.request_errors import ServerBusy

# how long a fleet answer (live workers, model cards) is reused; a worker's death shows in
# /health within this (plus the index's own liveness delay)
ANSWER_TTL_S = 0.5


class ProbeGate:
    """Admits cheap requests at ``rate_per_s`` (a bucket of as many), the excess after a
    wait, at most ``max_waiting`` at once; beyond those :class:`ServerBusy`."""

    def __init__(
        self,
        rate_per_s: float,
        max_waiting: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert rate_per_s > 0 and max_waiting >= 0, (rate_per_s, max_waiting)
        self.rate = rate_per_s
        self.burst = max(1.0, rate_per_s)
        self.max_waiting = max_waiting
        self.clock = clock
        self._tokens = self.burst
        self._at = clock()
        self.waiting = 0
        self.refused = 0  # answered busy, all time

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def admit_now(self) -> bool:
        """Take a token if one is free and nobody waits; False: call :meth:`admit`."""
        self._refill()
        if self._tokens >= 1 and not self.waiting:
            self._tokens -= 1
            return True
        return False

    async def admit(self) -> bool:
        """Returns (True) when the request may be served; raises :class:`ServerBusy` when
        the wait is full. Cancelled (its client left), it gives its place back."""
        if self.admit_now():
            return True
        if self.waiting >= self.max_waiting:
            self.refused += 1
            raise ServerBusy(
                f"requests other than generation and tokenizing are limited to "
                f"{self.rate:g} requests/s with {self.max_waiting} waiting "
                "(router.http_cheap_rate_per_s, router.http_cheap_max_waiting); retry later"
            )
        # a place in the queue: the tokens owed before it are the waiters ahead of it
        self.waiting += 1
        try:
            self._tokens -= 1  # taken now, repaid by the refill while it sleeps
            await asyncio.sleep(max(0.0, -self._tokens / self.rate))
        except asyncio.CancelledError:
            self._tokens += 1  # never served: the ones behind it need not wait for it
            raise
        finally:
            self.waiting -= 1
        return True
