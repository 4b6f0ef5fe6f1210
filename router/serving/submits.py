"""A router loop turn's submits to one worker as one Ray call (``WorkerServer.submit_many``).

A burst of requests placed on one worker in the same loop iteration would cost one Ray call
each (the call's own overhead dominates a small request's pickling); here they are gathered
per output channel until the loop's next iteration and sent together. Each request is still
admitted or refused on its own: the worker answers one result per request, in order, an
error in the place of a refused one; a call that fails as a whole (the worker died) fails
every request of it the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvstore.blocks.protocol import Admitted, CallerRef, WorkerRequest
from router.serving.channels import WorkerChannel, call_result, own_error
from router.serving.workers import WorkerGone


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
        self._pending: dict[str, _Batch] = {}  # channel id -> this iteration's batch
        self.calls = 0  # Ray calls sent
        self.requests = 0  # requests sent in them
        self._inflight: set[asyncio.Task] = set()  # held: the loop keeps tasks weakly

    def submit(self, ch: WorkerChannel, handle: Any, request: WorkerRequest) -> asyncio.Future:
        """A future of ``request``'s :class:`Admitted` (or its refusal). Cancelling it
        before the batch leaves keeps the request from being sent."""
        loop = asyncio.get_running_loop()
        batch = self._pending.get(ch.channel_id)
        if batch is None:
            batch = self._pending[ch.channel_id] = _Batch(ch, handle)
            loop.call_soon(self._send, ch.channel_id)
        waiter = loop.create_future()
        batch.requests.append(request)
        batch.waiters.append(waiter)
        return waiter

    def _send(self, channel_id: str) -> None:
        batch = self._pending.pop(channel_id)
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
