"""The streaming front's calls on the engine from other threads: ``fn(engine)`` run by the
engine thread between steps (waited for, awaited, or posted), or, for an export, beside the
forward in flight (``window.py``). With no loop running, the caller runs it under the lock."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from kvstore.blocks.errors import EngineStopped
from worker.engine.engine import Engine
from worker.engine.inbox import Command, Inbox
from worker.engine.metrics import EngineMetrics
from worker.engine.window import ForwardWindow

T = TypeVar("T")


class EngineCalls:
    """Mixin of :class:`~worker.engine.front.StreamingEngine` (the front owns these
    attributes and its ``_on_engine_thread``)."""

    engine: Engine
    window: ForwardWindow
    _inbox: Inbox
    _lock: threading.Lock  # held by whoever runs the engine (thread or stop())

    def metrics(self) -> EngineMetrics:
        return self.with_engine(Engine.metrics)

    def with_engine(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` between steps and return its result; blocks the calling thread
        (up to one step) while the loop runs. From asyncio code use
        :meth:`with_engine_async`."""
        if self._on_engine_thread():
            return fn(self.engine)
        future = self._call(fn)
        if future is None:  # no loop to ask: the engine is the caller's to read
            with self._lock, self.window.held():
                return fn(self.engine)
        return future.result()

    async def with_engine_async(self, fn: Callable[[Engine], T]) -> T:
        """:meth:`with_engine` for asyncio code: awaits, never blocks the loop."""
        future = self._call(fn)
        if future is None:
            with self._lock, self.window.held():
                return fn(self.engine)
        return await asyncio.wrap_future(future)

    async def with_cached_kv_async(self, fn: Callable[[Engine], T], timeout_s: float) -> T:
        """``fn(engine)`` in a helper thread as soon as the engine is idle or computing a
        forward (``window.py``), not after the step in flight: only for code that pins,
        reads and releases cached blocks (an export). TimeoutError after ``timeout_s``."""
        return await asyncio.to_thread(self.window.run, lambda: fn(self.engine), timeout_s)

    def post(self, fn: Callable[[Engine], object]) -> bool:
        """Run ``fn(engine)`` between steps without waiting for it (any thread); False when
        the engine is stopped. An exception in ``fn`` is the future's, never the loop's."""
        return self._call(fn) is not None

    def _call(self, fn: Callable[[Engine], T]) -> Future[T] | None:
        future: Future[T] = Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - the caller's to see
                future.set_exception(exc)

        try:
            self._inbox.submit(Command(call))
        except EngineStopped:
            return None
        return future
