"""What an event loop was doing while it stalled: a watchdog thread samples the loop
thread's Python stack while the loop is late, and the cyclic collector's pauses are timed
(``gc.callbacks``), so a stall is attributed to its callback or to a collection.

A diagnostic for benchmarks (``LoopLagProbe(trace=True)``): the watchdog wakes every
``period_s`` and needs the GIL to look, so a stall spent in one C call that holds the GIL
(a collection, a large unpickling) is seen only at its end, and its samples show the
frame that called into C. The collector's own pauses are measured exactly.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

_FRAMES = 14  # innermost frames kept per sample


@dataclass(slots=True)
class Stall:
    lag_ms: float  # how late the probe woke
    gc_ms: float  # collector pauses inside the stall
    gc_gens: tuple[int, ...]  # the generations collected then
    loop_cpu_ms: float  # the loop thread's own CPU time in the stall
    runq_ms: float  # its time runnable but not running (the OS ran others)
    proc_cpu_ms: float  # the process's CPU time in the stall (all its threads)
    samples: list[tuple[str, ...]] = field(default_factory=list)  # the loop thread's stacks

    def summary(self) -> dict:
        stacks = Counter(self.samples).most_common(3)
        return {
            "lag_ms": round(self.lag_ms, 2),
            "gc_ms": round(self.gc_ms, 2),
            "gc_gens": list(self.gc_gens),
            "loop_cpu_ms": round(self.loop_cpu_ms, 2),
            "runq_ms": round(self.runq_ms, 2),
            "proc_cpu_ms": round(self.proc_cpu_ms, 2),
            "samples": len(self.samples),
            "stacks": [{"n": n, "frames": list(s)} for s, n in stacks],
        }


class StallTracer:
    """Watches one loop through the probe's heartbeat: made on the loop's thread (the one it
    samples and whose scheduler clocks it reads), it is told by the probe, on that thread,
    when it should wake (:meth:`expect`, before each sleep) and when it woke (:meth:`woke`)."""

    def __init__(self, *, threshold_s: float = 0.008, keep: int = 12) -> None:
        loop_thread = threading.current_thread()
        self.thread_id = loop_thread.ident  # its key in sys._current_frames()
        self._schedstat = f"/proc/self/task/{loop_thread.native_id}/schedstat"
        self._at_expect = (0.0, 0.0, 0.0)  # (thread cpu, run-queue wait, process cpu)
        self.threshold_s = threshold_s
        self.period_s = threshold_s / 4
        self.keep = keep
        self.stalls: list[Stall] = []  # the longest ``keep``
        self.gc_pauses: Counter[int] = Counter()  # per generation: collections
        self.gc_ms: Counter[int] = Counter()  # per generation: total pause
        self.gc_max_ms: dict[int, float] = {}  # per generation: longest pause
        self._due = float("inf")  # when the probe should wake (perf_counter)
        self._samples: list[tuple[str, ...]] = []
        self._gc_start = 0.0
        self._gc_log: list[tuple[float, float, int]] = []  # (start, end, gen), recent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._watch, name="stall-trace", daemon=True)
        self._thread.start()

    def _clocks(self) -> tuple[float, float, float]:
        try:
            with open(self._schedstat) as f:
                runq = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            runq = 0.0
        return time.thread_time(), runq, time.process_time()

    def expect(self, due: float) -> None:
        """On the loop thread, before the probe sleeps until ``due``."""
        clocks = self._clocks()
        with self._lock:
            self._due = due
            self._samples = []
            self._at_expect = clocks

    def woke(self, now: float) -> None:
        """On the loop thread, when the probe woke."""
        with self._lock:
            due, samples, before = self._due, self._samples, self._at_expect
            self._due, self._samples = float("inf"), []
            lag = now - due
            if lag < self.threshold_s:
                return
            gcs = [(s, e, g) for s, e, g in self._gc_log if e > due and s < now]
        cpu, runq, proc = (1e3 * (b - a) for a, b in zip(before, self._clocks(), strict=True))
        overlap = sum(min(e, now) - max(s, due) for s, e, _ in gcs)
        stall = Stall(1e3 * lag, 1e3 * overlap, tuple(g for _, _, g in gcs), cpu, runq, proc)
        stall.samples = samples
        self.stalls.append(stall)
        self.stalls.sort(key=lambda s: -s.lag_ms)
        del self.stalls[self.keep :]

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
            return
        gen = info.get("generation", -1)
        ms = 1e3 * (now - self._gc_start)
        self.gc_pauses[gen] += 1
        self.gc_ms[gen] += ms
        self.gc_max_ms[gen] = max(self.gc_max_ms.get(gen, 0.0), ms)
        if ms >= 1.0:
            log = self._gc_log
            log.append((self._gc_start, now, gen))
            if len(log) > 64:
                del log[:32]

    def _watch(self) -> None:
        while not self._stop.wait(self.period_s):
            now = time.perf_counter()
            with self._lock:
                if now - self._due < self.threshold_s:
                    continue
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)[-_FRAMES:]
            sample = tuple(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in stack)
            with self._lock:
                if now - self._due >= self.threshold_s and len(self._samples) < 256:
                    self._samples.append(sample)

    def report(self) -> dict:
        return {
            "stalls": [s.summary() for s in self.stalls],
            "gc": {
                str(g): {
                    "n": self.gc_pauses[g],
                    "total_ms": round(self.gc_ms[g], 1),
                    "max_ms": round(self.gc_max_ms.get(g, 0.0), 2),
                }
                for g in sorted(self.gc_pauses)
            },
        }

    def reset(self) -> None:
        with self._lock:
            self.stalls = []
            self.gc_pauses.clear()
            self.gc_ms.clear()
            self.gc_max_ms.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def _short(path: str) -> str:
    return "/".join(path.split("/")[-3:])
