"""This router's output channel from one worker: one long-lived Ray stream carrying, per
message, every output of this router's requests there (``WorkerServer.outputs``), pumped
into per-request inboxes (:class:`~router.serving.request_inbox.Inbox`).

When the router itself lags (several of the worker's messages arrived while it was busy),
the pump reads all that are there before waking anyone, so every reader gets those steps'
tokens as one client message too.
A message carries a step's outputs for every request of this router on that worker (several
steps' when the router lagged): :func:`demultiplex` wakes their readers a slice at a time,
so one loop iteration runs a bounded number of client writes, never a whole message's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import ray

from kvstore.blocks.outputs import OUTPUT_SCHEMA
from router.placement.config import STREAM_INTERVAL
from router.serving.request_inbox import Inbox
from router.serving.workers import WorkerGone

log = logging.getLogger(__name__)
# readers woken per loop iteration at most: each then writes to its client (a gRPC message,
# an SSE event: ~50-100 us), so a slice is a few ms of the loop, whatever the batch size
WAKE_SLICE = 32
# worker messages (steps) joined into one demultiplexed batch at most, when the router lags
MAX_JOINED = 8
_ids = itertools.count()


async def demultiplex(items: list[Any], inboxes: dict[str, Inbox]) -> None:
    """Hand one channel message's ``items`` (packed outputs, StreamEnds) to their requests'
    inboxes, in order; an item whose reader left (client gone, aborted) is dropped. Every
    item is in its inbox before any reader wakes, so a reader takes all of its request's
    items of the message at once (one client message for several steps). Then the readers
    are woken :data:`WAKE_SLICE` at a time, yielding in between: their writes run before the
    next slice wakes, and every other ready callback (a probe, a new request) in between."""
    touched: dict[str, Inbox] = {}  # first appearance order
    for item in items:
        rid = item[0] if isinstance(item, tuple) else item.request_id
        inbox = inboxes.get(rid)
        if inbox is not None:
            inbox.items.append(item)
            touched[rid] = inbox
    woken = 0
    for inbox in touched.values():
        if inbox.wake():
            woken += 1
            if woken == WAKE_SLICE:
                woken = 0
                await asyncio.sleep(0)


class WorkerChannel:
    """This router's output stream from one worker, pumped into per-request inboxes."""

    def __init__(self, worker_id: str, handle: Any, incarnation: str, caller: Any = None) -> None:
        """``caller``: this router's CallerRef; the worker drops the channel once it dies."""
        self.worker_id = worker_id
        self.channel_id = f"{incarnation}/{worker_id}/{next(_ids)}"  # new per (re)open
        self.inboxes: dict[str, Inbox] = {}
        self.error: WorkerGone | None = None  # set once the stream ended
        self.last_message = time.monotonic()  # when the worker last sent anything
        self.messages = 0
        self.joined = 0  # worker messages read together with an earlier one (lag)
        # whether the worker holds this router's caller for the channel (a request of it
        # came back admitted): later requests go without it
        self.caller_known = False
        self.callers_sent = 0  # requests sent with the caller
        self.last_submit = float("-inf")  # when its last submit call left (loop time)
        self._gen: Any = None  # the Ray stream, once opened
        self._task = asyncio.get_running_loop().create_task(self._pump(handle, caller))

    @property
    def open_for_requests(self) -> bool:
        return self.error is None

    def open(self, request_id: str, interval: int = STREAM_INTERVAL) -> Inbox:
        inbox = self.inboxes[request_id] = Inbox(interval)
        if self.error is not None:
            inbox.put(self.error)
        return inbox

    def close(self, request_id: str) -> None:
        inbox = self.inboxes.pop(request_id, None)
        if inbox is not None:
            inbox.close()

    async def _pump(self, handle: Any, caller: Any) -> None:
        error = WorkerGone(f"the output channel from {self.worker_id} failed")
        try:
            gen = self._gen = handle.outputs.options(num_returns="streaming").remote(
                self.channel_id, caller, OUTPUT_SCHEMA
            )
            async for ref in gen:
                items = await ref
                later = await self._join_ready(gen, items)
                self.last_message = time.monotonic()
                self.messages += 1
                await demultiplex(items, self.inboxes)
                if later is not None:  # the stream failed after the messages joined
                    raise later
            error = WorkerGone(f"worker {self.worker_id} ended its output channel")
        except asyncio.CancelledError:
            error = WorkerGone(f"the output channel from {self.worker_id} was closed")
            raise
        except Exception as exc:  # noqa: BLE001 - the worker died or the stream broke
            error = WorkerGone(f"output channel from {self.worker_id}: {_first_line(exc)}")
        finally:
            self.error = error
            for inbox in self.inboxes.values():
                inbox.put(error)

    async def _join_ready(self, gen: Any, items: list[Any]) -> Exception | None:
        """Append to ``items`` the worker's messages already there (this router lagged its
        steps), up to :data:`MAX_JOINED` in all, so each reader takes its tokens of all of
        them as one client message. Returns the stream's error if it failed meanwhile (the
        items before it are handed out first)."""
        try:
            for _ in range(MAX_JOINED - 1):
                if not gen.next_ready():
                    break
                items.extend(await (await gen.__anext__()))
                self.joined += 1
        except StopAsyncIteration:  # the stream ended after these
            pass
        except Exception as exc:  # noqa: BLE001 - raised once its predecessors are out
            return exc
        return None

    def stop(self) -> None:
        """Stop reading; the worker's side ends too (and aborts what still runs there)."""
        self._task.cancel()
        if self._gen is not None:
            try:
                ray.cancel(self._gen)
            except Exception as exc:  # noqa: BLE001 - the worker may be gone already
                log.debug("cancelling the channel from %s: %s", self.worker_id, exc)


def _first_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError's text is the worker's traceback
    if isinstance(cause, Exception):  # its own error (e.g. WireMismatch) says what happened
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
