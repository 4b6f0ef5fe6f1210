"""The router's decide thread: it owns the :class:`Router` (not thread-safe, and its index
reads block), so the event loop never waits on Redis.

The loop gathers the placements and settles of one loop iteration and queues them as one
(one thread wake-up per iteration, not per request); the thread takes everything queued at
once and works through it in arrival order: a run of placements reads the index in one round trip
(:meth:`Router.prepare`) and is then decided one by one, each seeing its predecessors'
placements. The answers go back to the loop in one hand-off per batch, not one per request:
a burst of 256 requests costs a few thread wake-ups and round trips, not 256 of each.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class DecideThread:
    """``place_batch(jobs)`` runs on the thread: ``jobs`` is a list of the ``args`` tuples
    given to :meth:`place`, in order; it returns one result (or exception) per job.
    ``dropped(args, result)`` runs on the loop for a job whose caller left before its
    answer came (a placement nobody will use: its bookkeeping is undone there)."""

    def __init__(
        self,
        place_batch: Callable[[Sequence[tuple]], list[Any]],
        dropped: Callable[[tuple, Any], None] | None = None,
        name: str = "route",
    ) -> None:
        self._place_batch = place_batch
        self._dropped = dropped
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._gathered: dict[asyncio.AbstractEventLoop, list] = {}  # per loop, this iteration's
        self.batches = 0  # runs of placements decided together
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def place(self, *args: Any) -> asyncio.Future:
        """A future of the job's result, set on this loop; cancel it to drop the answer."""
        if self._closed:
            raise RuntimeError("the decide thread is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._gather(loop, (loop, fut, args))
        return fut

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread after everything queued before it (no answer)."""
        if self._closed:
            raise RuntimeError("the decide thread is closed")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: nothing of this caller is gathered
            self._queue.put([(None, fn, args)])
            return
        self._gather(loop, (None, fn, args))

    def _gather(self, loop: asyncio.AbstractEventLoop, item: tuple) -> None:
        items = self._gathered.get(loop)
        if items is None:
            items = self._gathered[loop] = []
            loop.call_soon(self._hand_over, loop)
        items.append(item)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        items = self._gathered.pop(loop, [])
        if not self._closed:
            self._queue.put(items)
            return
        for fut in (i[1] for i in items if i[0] is not None):  # closed meanwhile: refused
            if not fut.done():
                fut.set_exception(RuntimeError("the decide thread is closed"))

    def close(self) -> None:
        """Stop after the work handed over (placements gathered since are refused)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)

    def _run(self) -> None:
        q = self._queue
        while True:
            lists = [q.get()]
            while True:
                try:
                    lists.append(q.get_nowait())
                except queue.Empty:
                    break
            stop = any(x is _STOP for x in lists)
            self._work([i for x in lists if x is not _STOP for i in x])
            if stop:
                return

    def _work(self, items: list) -> None:
        run: list = []  # consecutive placements
        for item in items:
            if item[0] is None:  # a call: after the placements queued before it
                self._decide(run)
                run = []
                _, fn, args = item
                try:
                    fn(*args)
                except Exception:  # noqa: BLE001 - one call's failure stops nothing else
                    log.exception("decide-thread call %r failed", fn)
            else:
                run.append(item)
        self._decide(run)

    def _decide(self, run: list) -> None:
        if not run:
            return
        self.batches += 1
        try:
            results = self._place_batch([args for _, _, args in run])
        except Exception as exc:  # noqa: BLE001 - the batch failed as a whole: each job
            results = [exc] * len(run)
        assert len(results) == len(run), (len(results), len(run))
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for (loop, fut, args), result in zip(run, results, strict=True):
            by_loop.setdefault(loop, []).append((fut, result, args))
        for loop, answers in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, answers)
            except RuntimeError:  # that loop is closed: nobody waits for the answers
                pass

    def _deliver(self, answers: list) -> None:
        for fut, result, args in answers:
            if fut.done():  # its caller left (cancelled)
                if self._dropped is not None and not isinstance(result, BaseException):
                    self._dropped(args, result)
            elif isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
