"""A circuit breaker in front of the router's index reads.

A Redis that is down refuses connections at once, but a frozen one (SIGSTOP, a stalled
VM, a network black hole) accepts them and never answers: every read waits out its socket
timeout. Without a breaker each request pays that wait, more than once (live workers, then
the prefix lookup). With it, the first failure opens the circuit: reads fail fast and the
router routes by load at normal latency; every ``probe_interval_s`` one read is let through
as a probe, and the first probe that succeeds closes the circuit again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class CircuitOpen(Exception):
    """The index failed recently; this read was not attempted (route by load)."""


class CircuitBreaker:
    """Closed -> (a failure) -> open -> (``probe_interval_s``) -> one probe -> closed or open.

    Thread-safe: the router reads the index from its decide thread and from the event loop's
    worker threads. Callers must pass every index read through :meth:`call`, so a probe's
    outcome is always reported.
    """

    def __init__(
        self, probe_interval_s: float = 1.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if probe_interval_s <= 0:
            raise ValueError(f"probe_interval_s must be > 0, got {probe_interval_s}")
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._opened_at: float | None = None  # None: closed
        self._probing = False  # a probe is in flight: other reads keep failing fast
        self.failures = 0  # reads that were attempted and failed
        self.skipped = 0  # reads not attempted because the circuit was open
        self.opened = 0  # closed -> open transitions
        self.last_error = ""  # the failure that opened the circuit (or the last probe's)

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def _admit(self) -> bool:
        """Whether this read may go to the index (closed, or it is the next probe)."""
        with self._lock:
            if self._opened_at is None:
                return True
            if not self._probing and self._clock() - self._opened_at >= self.probe_interval_s:
                self._probing = True
                return True
            self.skipped += 1
            return False

    def _record(self, error: BaseException | None) -> None:
        with self._lock:
            self._probing = False
            if error is None:
                self._opened_at = None
                return
            self.failures += 1
            self.last_error = f"{type(error).__name__}: {error}"
            if self._opened_at is None:
                self.opened += 1
            self._opened_at = self._clock()  # a failed probe waits a full interval again

    def call(
        self, fn: Callable[[], T], *, failures: tuple[type[BaseException], ...] = (Exception,)
    ) -> T:
        """``fn()`` unless the circuit is open (then :class:`CircuitOpen`); an exception in
        ``failures`` opens it (and propagates), a return closes it."""
        if not self._admit():
            raise CircuitOpen(f"index circuit open after: {self.last_error}")
        try:
            result = fn()
        except failures as exc:
            self._record(exc)
            raise
        except BaseException:
            self._release()  # not an index failure (e.g. a bad argument): no verdict
            raise
        self._record(None)
        return result

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        failures: tuple[type[BaseException], ...] = (Exception,),
    ) -> T:
        """:meth:`call` for a coroutine function."""
        if not self._admit():
            raise CircuitOpen(f"index circuit open after: {self.last_error}")
        try:
            result = await fn()
        except failures as exc:
            self._record(exc)
            raise
        except BaseException:
            self._release()
            raise
        self._record(None)
        return result

    def _release(self) -> None:
        with self._lock:
            self._probing = False

    def snapshot(self) -> dict[str, int | bool]:
        return {
            "index_circuit_open": self.is_open,
            "index_circuit_opened": self.opened,
            "index_failures": self.failures,
            "index_skipped": self.skipped,
        }
