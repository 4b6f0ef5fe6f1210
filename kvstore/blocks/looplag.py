"""How long an asyncio event loop fails to run a ready callback: a probe task that sleeps
``interval_s`` and records how late it wakes. Workers and routers run one on demand, so a
benchmark can show that neither loop ever waits (for an engine step, a lock, a pickling)."""

from __future__ import annotations

import asyncio
import time


class LoopLagProbe:
    """Started by the first :meth:`report` on the loop to watch; cheap (a wake-up every
    ``interval_s``)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self.max_lag_s = 0.0  # since the last reset
        self.samples = 0
        self._over_10ms = 0

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = time.perf_counter() - t0 - self.interval_s
            self.samples += 1
            if lag > 0.010:
                self._over_10ms += 1
            if lag > self.max_lag_s:
                self.max_lag_s = lag

    def report(self, *, reset: bool = False) -> dict[str, float]:
        """The largest lag (ms) and the count of wake-ups later than 10 ms since the last
        reset; call on the loop being watched."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        out = {
            "max_lag_ms": self.max_lag_s * 1e3,
            "samples": float(self.samples),
            "over_10ms": float(self._over_10ms),
        }
        if reset:
            self.max_lag_s, self.samples, self._over_10ms = 0.0, 0, 0
        return out

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
