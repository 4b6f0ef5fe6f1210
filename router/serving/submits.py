"""A router loop turn's submits to one worker as one Ray call (``WorkerServer.submit_many``).

A burst of requests placed on one worker would cost one Ray call each; here they are
gathered per output channel and sent together. A burst's requests reach placement one or two
per loop iteration (each has its own intake and index lookup), so one iteration gathers few:
while requests keep coming to a worker (its previous call left less than
:data:`SUBMIT_WINDOW_S` ago), its next call waits out the window, gathering what comes
meanwhile; the first call after a quiet spell leaves on the next iteration, adding no
latency. A batch of :data:`WAKE_SLICE` leaves at once (its pickling is one stretch of the
loop). Each request is still
admitted or refused on its own: the worker answers one result per request, in order, an
error in the place of a refused one; a call that fails as a whole (the worker died) fails
every request of it the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvstore.blocks.protocol import Admitted, CallerRef, WorkerRequest
from router.serving.worker_call_errors import call_result, own_error
from router.serving.worker_channel import WAKE_SLICE, WorkerChannel
from router.serving.workers import WorkerGone

# the shortest time between two submit calls to one worker while requests keep coming: a few
# ms against a burst's time to first token (its requests wait for the engine's next step)
SUBMIT_WINDOW_S = 0.005


@dataclass(slots=True)
class _Batch:
    channel: WorkerChannel
    handle: Any
    requests: list[WorkerRequest] = field(default_factory=list)
    waiters: list[asyncio.Future] = field(default_factory=list)


class SubmitBatcher:
    """Gathers submits per channel within one loop iteration; sends each gathered batch
    as one call on the next iteration."""

    def __init__(self, caller: CallerRef | None, incarnation: str) -> None:
        self.caller = caller
        self.incarnation = incarnation
        self._pending: dict[str, _Batch] = {}  # channel id -> the batch not yet sent
        self.calls = 0  # Ray calls sent
        self.requests = 0  # requests sent in them
        self._inflight: set[asyncio.Task] = set()  # held: the loop keeps tasks weakly

    def submit(self, ch: WorkerChannel, handle: Any, request: WorkerRequest) -> asyncio.Future:
        """A future of ``request``'s :class:`Admitted` (or its refusal). Cancelling it
        before the batch leaves keeps the request from being sent."""
        loop = asyncio.get_running_loop()
        key = ch.channel_id
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = _Batch(ch, handle)
            due = ch.last_submit + SUBMIT_WINDOW_S
            if due <= loop.time():
                loop.call_soon(self._send, key, batch)
            else:
                loop.call_at(due, self._send, key, batch)
        waiter = loop.create_future()
        batch.requests.append(request)
        batch.waiters.append(waiter)
        if len(batch.requests) == WAKE_SLICE:
            loop.call_soon(self._send, key, batch)
        return waiter

    def _send(self, channel_id: str, batch: _Batch) -> None:
        if self._pending.get(channel_id) is not batch:
            return  # sent already (it filled up before its timer)
        del self._pending[channel_id]
        batch.channel.last_submit = asyncio.get_running_loop().time()
        kept = [(r, w) for r, w in zip(batch.requests, batch.waiters, strict=True) if not w.done()]
        if not kept:
            return
        ch = batch.channel
        # the caller (an actor handle, costly to unpickle) goes until the worker has it for
        # the channel (a request came back admitted), then only its id
        caller: Any = self.caller
        if caller is not None and ch.caller_known:
            caller = self.incarnation
        elif caller is not None:
            ch.callers_sent += len(kept)
        requests = [r for r, _ in kept]
        ref = batch.handle.submit_many.remote(requests, caller, channel_id)
        self.calls += 1
        self.requests += len(requests)
        task = asyncio.get_running_loop().create_task(self._settle(ref, ch, [w for _, w in kept]))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _settle(self, ref: Any, ch: WorkerChannel, waiters: list[asyncio.Future]) -> None:
        try:
            results = await call_result(ref)
        except Exception as exc:  # noqa: BLE001 - the call failed as a whole: each request
            for w in waiters:
                if not w.done():
                    w.set_exception(WorkerGone(str(exc)) if isinstance(exc, WorkerGone) else exc)
            return
        assert len(results) == len(waiters), (len(results), len(waiters))
        for w, result in zip(waiters, results, strict=True):
            if isinstance(result, Admitted):
                ch.caller_known = True
            if w.done():  # its reader left (the request runs: the reader's abort ends it)
                continue
            if isinstance(result, Exception):
                w.set_exception(own_error(result))
            else:
                w.set_result(result)
