"""Small helpers shared by the engine tests."""

from __future__ import annotations

import asyncio
import threading
import time

from worker.engine import Engine, GenerationResult


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, GenerationResult]:
    """Step until every request finished; results by request id."""
    results: dict[str, GenerationResult] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            results.setdefault(out.request_id, GenerationResult(out.request_id, [])).add(out)
    raise AssertionError(f"not finished after {max_steps} steps")


def assert_no_blocks_in_use(engine: Engine) -> None:
    engine.kv.check_invariants()
    stats = engine.kv.stats()
    assert stats.used_blocks == 0, stats
    assert stats.num_seqs == 0, stats


class HeldSteps:
    """Wraps ``engine.step`` so that, while holding, every step stays in progress (its
    thread blocked inside it, as a long model step keeps an accelerator busy) until the test
    lets it go: a test then knows a step is running for as long as it needs, however slowly
    the machine schedules anyone. A held step gives up after ``cap_s`` and holding ends:
    :meth:`release` then says False (whoever should have released it was blocked); the cap
    is longer than :meth:`LoopTurns.answered` waits."""

    def __init__(self, engine: Engine, cap_s: float = 20.0) -> None:
        self._step = engine.step
        engine.step = self._gated  # type: ignore[method-assign]
        self.cap_s = cap_s
        self._cond = threading.Condition()
        self.holding = False
        self.entered = 0  # steps that reached the gate while holding
        self._permits = 0
        self.gave_up = False

    def _gated(self) -> list:
        with self._cond:
            if self.holding:
                self.entered += 1
                self._cond.notify_all()
                if not self._cond.wait_for(lambda: self._permits or not self.holding, self.cap_s):
                    self.gave_up, self.holding = True, False
                elif self._permits:
                    self._permits -= 1
        return self._step()

    def hold(self) -> None:
        with self._cond:
            self.holding = True

    def free(self) -> None:
        """Stop holding: the step held now and all later ones run."""
        with self._cond:
            self.holding = False
            self._cond.notify_all()

    def release(self) -> bool:
        """Let the step held now go (the next one is held again); False if it gave up."""
        with self._cond:
            self._permits += 1
            self._cond.notify_all()
            return not self.gave_up

    def wait_in_step(self, n: int, timeout_s: float = 30.0) -> bool:
        """Block until the ``n``-th held step is in progress (False after ``timeout_s``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.entered >= n, timeout_s)

    async def in_step(self, n: int) -> bool:
        """:meth:`wait_in_step` without blocking the loop."""
        return await asyncio.to_thread(self.wait_in_step, n)


class LoopTurns:
    """A probe on the running loop: a task sleeping ``interval_s`` at a time and recording
    how late each wake-up is; counted from :meth:`start`."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.lags = []
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags.append(time.perf_counter() - t0 - self.interval_s)

    async def answered(self, n: int, timeout_s: float = 10.0) -> list[float]:
        """Wait until the probe woke ``n`` times since :meth:`start`; those lags (s)."""
        deadline = time.perf_counter() + timeout_s
        while len(self.lags) < n and time.perf_counter() < deadline:
            await asyncio.sleep(self.interval_s)
        return list(self.lags)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
