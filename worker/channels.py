"""Per-router output channels of a worker: one message per step for all of a router's
requests, instead of one Ray stream item per request per step.

A router opens one channel per worker (``WorkerServer.outputs``, a long-lived Ray streaming
generator) and names it in every request it submits there. The engine thread hands each
channel one batch per step (the channel is the requests' :class:`OutputSink`); the generator
yields what gathered since its last item, so a router that reads slower than the engine steps
gets fewer, larger messages and never slows the engine. The router demultiplexes each batch
to its requests' streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvstore.requests.outputs import OUTPUT_SCHEMA, PackedOutput, RequestOutput, pack_output
from kvstore.requests.wire import check_schema
from worker.engine.streams import OutputSink, StreamEnd, StreamItem

log = logging.getLogger(__name__)


class Channel(OutputSink):
    """The outputs of one router's requests on this worker, gathered between reads."""

    def __init__(
        self, channel_id: str, loop: asyncio.AbstractEventLoop, on_end: Callable[[str], None]
    ) -> None:
        self.channel_id = channel_id
        self.loop = loop
        self._on_end = on_end  # a request's stream ended (its caller need not be watched)
        self._pending: list[StreamItem] = []
        self._ready = asyncio.Event()
        self.requests: set[str] = set()  # open requests sent through this channel
        self.caller: Any = None  # the router's CallerRef (or handle), for the watch
        self.attached = False  # a reader is attached
        self.closed = False

    def open(self, request_id: str) -> None:
        self.requests.add(request_id)

    def deliver(self, items: list[StreamItem]) -> None:
        self._pending.extend(items)
        for item in items:
            if not isinstance(item, RequestOutput) or item.finished:
                self.requests.discard(item.request_id)
                self._on_end(item.request_id)
        self._ready.set()

    async def batches(self) -> AsyncIterator[list[PackedOutput | StreamEnd]]:
        """Everything delivered since the previous batch, in order (never empty); outputs
        packed (:func:`pack_output`)."""
        while not self.closed:
            await self._ready.wait()
            self._ready.clear()
            if self._pending:
                items, self._pending = self._pending, []
                yield [pack_output(i) if isinstance(i, RequestOutput) else i for i in items]

    def close(self) -> None:
        self.closed = True
        self._ready.set()


class Channels:
    """A worker's open channels by id (the actor's event loop only)."""

    def __init__(
        self,
        abort: Callable[[str], object],
        on_end: Callable[[str], None],
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        """``on_end(request_id)``: a request's stream ended; ``on_drop(channel_id)``: a
        channel was closed (its caller need not be watched any more)."""
        self._abort = abort
        self._on_end = on_end
        self._on_drop = on_drop
        self._by_id: dict[str, Channel] = {}

    def get(self, channel_id: str) -> Channel:
        """The channel, created on first use: a request may arrive before its reader."""
        ch = self._by_id.get(channel_id)
        if ch is None:
            ch = self._by_id[channel_id] = Channel(
                channel_id, asyncio.get_running_loop(), self._on_end
            )
        return ch

    def find(self, channel_id: str) -> Channel | None:
        return self._by_id.get(channel_id)

    async def serve(
        self, channel_id: str, schema: str | None
    ) -> AsyncIterator[list[PackedOutput | StreamEnd]]:
        """The reader's side: batches until the router closes the channel. A router that
        stops reading (it closed the channel or died) gets its open requests aborted.
        ``schema``: the reader's packed-output layout (``OUTPUT_SCHEMA``); another one is
        refused (:class:`WireMismatch`) before anything is sent."""
        check_schema("output channel", schema, OUTPUT_SCHEMA)
        ch = self.get(channel_id)
        if ch.attached:
            raise RuntimeError(f"channel {channel_id!r} already has a reader")
        ch.attached = True
        try:
            async for items in ch.batches():
                yield items
        finally:
            self.drop(channel_id)

    def drop(self, channel_id: str) -> None:
        """Close a channel and abort what its requests still run."""
        ch = self._by_id.pop(channel_id, None)
        if ch is None:
            return
        ch.close()
        if self._on_drop is not None:
            self._on_drop(channel_id)
        if ch.requests:
            log.info(
                "channel %s closed with %d open request(s): aborting", channel_id, len(ch.requests)
            )
        for rid in list(ch.requests):
            self._abort(rid)
        ch.requests.clear()

    def of_caller(self, caller: Any) -> list[str]:
        """The ids of the channels opened by ``caller``."""
        return [cid for cid, ch in self._by_id.items() if ch.caller == caller]

    def ids(self) -> list[str]:
        return list(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)
