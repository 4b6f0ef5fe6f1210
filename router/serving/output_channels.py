"""A router's output channels: one long-lived Ray stream per worker carrying, per message,
every output of this router's requests there (``WorkerServer.outputs``), split here into
per-request inboxes.

The pump only appends to inboxes, so a slow client never holds up the channel, the worker or
another client; a request's reader takes everything its inbox gathered at once and reads it
as one output (:func:`coalesce`), so a client that lags gets several tokens per message.
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
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from kvstore.blocks.errors import EngineStopped, UnknownChannel
from kvstore.blocks.outputs import OUTPUT_SCHEMA, RequestOutput, coalesce, unpack_output
from router.serving.workers import WorkerGone

log = logging.getLogger(__name__)
ACTOR_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)  # the actor is gone
# readers woken per loop iteration at most: each then writes to its client (a gRPC message,
# an SSE event: ~50-100 us), so a slice is a few ms of the loop, whatever the batch size
WAKE_SLICE = 32
# worker messages (steps) joined into one demultiplexed batch at most, when the router lags
MAX_JOINED = 8
_CLOCK_SLACK_S = 1e-3  # a timer may fire this early (the loop's clock resolution)
_ids = itertools.count()


class Inbox:
    """One request's outputs as they arrive, read in batches; a waiter is one future (no
    task per item). Its stall timeout is one timer for the request, re-armed when it fires
    and the reader waited less than the timeout (not one timer per wait, i.e. per token).

    ``interval`` (the router's ``stream_interval``): the reader is woken once that many
    steps' outputs are there, so each client message carries at least that many steps'
    tokens; the first output, the last one and anything that is not an output (an error, a
    stream end) wake it at once, and a stall timeout hands over what has gathered."""

    __slots__ = ("items", "interval", "_first", "_waiter", "_since", "_timer", "timers")

    def __init__(self, interval: int = 1) -> None:
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

    def open(self, request_id: str, interval: int = 1) -> Inbox:
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


class Channels:
    """One channel per worker, reopened after it ended (the worker died or restarted)."""

    def __init__(self, incarnation: str, caller: Any = None) -> None:
        self.incarnation = incarnation
        self._caller = caller
        self._by_worker: dict[str, WorkerChannel] = {}

    def get(self, worker_id: str, handle: Any = None) -> WorkerChannel:
        """The open channel to ``worker_id``, (re)opened through ``handle`` if there is none."""
        ch = self._by_worker.get(worker_id)
        if ch is None or not ch.open_for_requests:
            assert handle is not None, f"no open channel to {worker_id}"
            ch = WorkerChannel(worker_id, handle, self.incarnation, self._caller)
            self._by_worker[worker_id] = ch
        return ch

    def close(self) -> None:
        for ch in self._by_worker.values():
            ch.stop()
        self._by_worker.clear()


async def call_result(ref: Any) -> Any:
    """A Ray call's result with the worker's own errors as themselves (InvalidRequest,
    EngineOverloaded raised there); an engine that stopped or an actor that died is
    :class:`WorkerGone`."""
    try:
        return await ref
    except ACTOR_ERRORS as exc:
        raise WorkerGone(str(exc).splitlines()[0]) from exc
    except RayTaskError as exc:
        if isinstance(exc.cause, Exception):  # its own exception, not Ray's traceback
            err = own_error(exc.cause)
            if isinstance(err, WorkerGone):
                raise err from exc
            raise err from None
        raise


def own_error(exc: Exception) -> Exception:
    """A worker's refusal of one request as the router acts on it: an engine that died (the
    worker is going down) or a channel it lost (it restarted since the channel opened) is
    :class:`WorkerGone`; anything else is itself."""
    if isinstance(exc, (EngineStopped, UnknownChannel)):
        return WorkerGone(str(exc))
    return exc
