"""How long an asyncio event loop fails to run a ready callback: a probe task that sleeps
``interval_s`` and records how late it wakes. Workers and routers run one on demand, so a
benchmark can show that neither loop ever waits (for an engine step, a lock, a pickling).
With ``trace``, each stall is attributed too (:mod:`kvstore.runtime.stalltrace`)."""

from __future__ import annotations

import asyncio
import time

from kvstore.runtime.loop_sched import thread_sched
from kvstore.runtime.stalltrace import StallTracer


class LoopLagProbe:
    """Started by the first :meth:`report` on the loop to watch; cheap (a wake-up every
    ``interval_s``)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self.max_lag_s = 0.0  # since the last reset
        self.samples = 0
        self._over_10ms = 0
        self.tracer: StallTracer | None = None  # on once a report asks for traces

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            tracer = self.tracer
            if tracer is not None:
                tracer.expect(t0 + self.interval_s)
            await asyncio.sleep(self.interval_s)
            now = time.perf_counter()
            if tracer is not None:
                tracer.woke(now)
            lag = now - t0 - self.interval_s
            self.samples += 1
            if lag > 0.010:
                self._over_10ms += 1
            if lag > self.max_lag_s:
                self.max_lag_s = lag

    def report(self, *, reset: bool = False, trace: bool = False) -> dict:
        """The largest lag (ms) and the count of wake-ups later than 10 ms since the last
        reset, the loop's class (``uvloop.Loop`` where Ray found uvloop) and what the kernel
        runs its thread with (``sched``: slice and niceness, ``kvstore/runtime/loop_sched.py``);
        call on the loop being watched. ``trace``: from now on also attribute each
        stall (its stacks, the collector's pauses), reported under ``trace``."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        out: dict = {
            "loop": f"{type(loop).__module__}.{type(loop).__qualname__}",
            "sched": thread_sched(),
            "max_lag_ms": self.max_lag_s * 1e3,
            "samples": float(self.samples),
            "over_10ms": float(self._over_10ms),
        }
        if self.tracer is not None:
            out["trace"] = self.tracer.report()
        elif trace:
            self.tracer = StallTracer()
        if reset:
            self.max_lag_s, self.samples, self._over_10ms = 0.0, 0, 0
            if self.tracer is not None:
                self.tracer.reset()
        return out

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.tracer is not None:
            self.tracer.stop()
            self.tracer = None
