"""One request's inbox at the router: the outputs its worker's channel
(:class:`~router.serving.worker_channel.WorkerChannel`) handed to it, read in batches.

The pump only appends to inboxes, so a slow client never holds up the channel, the worker or
another client; a request's reader takes everything its inbox gathered at once and reads it
as one output (:func:`coalesce`), so a client that lags gets several tokens per message.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.blocks.outputs import RequestOutput, coalesce, unpack_output
from router.placement.config import STREAM_INTERVAL

_CLOCK_SLACK_S = 1e-3  # a timer may fire this early (the loop's clock resolution)


class Inbox:
    """One request's outputs as they arrive, read in batches; a waiter is one future (no
    task per item). Its stall timeout is one timer for the request, re-armed when it fires
    and the reader waited less than the timeout (not one timer per wait, i.e. per token).

    ``interval`` (the router's ``stream_interval``): the reader is woken once that many
    steps' outputs are there, so each client message carries at least that many steps'
    tokens; the first output, the last one and anything that is not an output (an error, a
    stream end) wake it at once, and a stall timeout hands over what has gathered."""

    __slots__ = ("items", "interval", "_first", "_waiter", "_since", "_timer", "timers")

    def __init__(self, interval: int = STREAM_INTERVAL) -> None:
        self.items: list[Any] = []  # packed outputs (tuples), StreamEnd, WorkerGone, in order
        self.interval = interval
        self._first = True  # no output taken yet (the first token is never held back)
        self._waiter: asyncio.Future | None = None
        self._since = 0.0  # when the current wait began (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self.timers = 0  # timers armed for this request

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.wake()

    def ready(self) -> bool:
        """Whether the reader has something to take now: items (it may have taken them
        since they came: a reader woken to nothing would take nothing), as many as the
        interval asks unless the stream starts, ends or fails with them."""
        items = self.items
        if not items:
            return False
        if self.interval == 1 or self._first or len(items) >= self.interval:
            return True
        last = items[-1]
        return not isinstance(last, tuple) or bool(last[2])  # an end, an error, finished

    def wake(self) -> bool:
        """Wake the reader if it waits and :meth:`ready`; True if it did (it runs on the
        loop's next iteration)."""
        w = self._waiter
        if w is not None and not w.done() and self.ready():
            w.set_result(True)
            return True
        return False

    async def wait(self, timeout_s: float) -> bool:
        """True when :meth:`ready`; after ``timeout_s`` True if items gathered meanwhile
        (fewer than the interval: handed over), else False."""
        if self.ready():
            return True
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        self._since = loop.time()
        if self._timer is None:
            self._arm(loop, self._since + timeout_s, timeout_s)
        try:
            return await w
        finally:
            self._waiter = None

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float, timeout_s: float) -> None:
        self.timers += 1
        self._timer = loop.call_at(when, self._expire, loop, timeout_s)

    def _expire(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return  # the reader is not waiting: its next wait arms a timer
        due = self._since + timeout_s
        if loop.time() + _CLOCK_SLACK_S >= due:
            w.set_result(bool(self.items))
        else:  # this wait began after the timer was armed
            self._arm(loop, due, timeout_s)

    def close(self) -> None:
        """The request's stream ended: its timer goes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def take(self) -> RequestOutput | Any:
        """What arrived, as one output: the outputs before the first non-output joined
        (:func:`coalesce`); a non-output (an error, a stream end) alone when it is first."""
        items = self.items
        if len(items) == 1 and isinstance(items[0], tuple):  # (the common case: one step's)
            self.items = []
            self._first = False
            return unpack_output(items[0])
        head = 0
        while head < len(items) and isinstance(items[head], tuple):
            head += 1
            if items[head - 1][2]:  # finished
                break
        if head == 0:
            return items.pop(0)
        taken, self.items = items[:head], items[head:]
        self._first = False
        return coalesce([unpack_output(p) for p in taken])
