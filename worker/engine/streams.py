"""Where the engine loop delivers outputs: sinks, and the per-request stream.

The engine thread hands each sink one list per step (its requests' outputs of that step, in
order). A sink with a ``loop`` gets it on that event loop (one ``call_soon_threadsafe`` per
loop per step, whatever the number of sinks and requests); a sink without one gets it in the
engine thread. A :class:`RequestStream` is the sink of one request; the worker actor's
per-router channels are sinks shared by many requests.
"""

from __future__ import annotations

import asyncio
import queue
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.blocks.outputs import GenerationResult, RequestOutput
from kvstore.blocks.wire import ByName


@dataclass(frozen=True, slots=True)
class StreamEnd(ByName):
    """A request's stream ends with this error instead of a finished output (the engine
    stopped or its loop died)."""

    request_id: str
    error: BaseException


StreamItem = RequestOutput | StreamEnd


class OutputSink(ABC):
    """Receives the outputs of the requests added with it.

    ``deliver`` runs on ``loop`` (or, when ``loop`` is None, in the engine thread, where it
    must not block); it gets every output of its requests exactly once, in order, and a
    :class:`StreamEnd` for a request that ends without a finished output.
    """

    loop: asyncio.AbstractEventLoop | None = None

    @abstractmethod
    def deliver(self, items: list[StreamItem]) -> None:
        """This step's items for this sink's requests."""


def deliver_all(batches: list[tuple[OutputSink, list[StreamItem]]]) -> None:
    """One step's items for every sink of one event loop (runs on that loop)."""
    for sink, items in batches:
        sink.deliver(items)


def dispatch(sinks: dict[str, OutputSink], items: Sequence[StreamItem]) -> list[str]:
    """Hand ``items`` to their requests' sinks (``sinks``: request id -> sink; a request's
    entry goes with its last item): in this thread for sinks without a loop, one
    ``call_soon_threadsafe`` per event loop for the others. Returns the ids of the unfinished
    requests whose loop was closed (dropped from ``sinks``: the caller aborts them)."""
    by_loop: dict[asyncio.AbstractEventLoop | None, dict[OutputSink, list[StreamItem]]] = {}
    for item in items:
        sink = sinks.get(item.request_id)
        if sink is None:
            continue
        if isinstance(item, StreamEnd) or item.finished:
            del sinks[item.request_id]
        by_loop.setdefault(sink.loop, {}).setdefault(sink, []).append(item)
    orphans: list[str] = []
    for loop, batches in by_loop.items():
        if loop is None:
            for sink, sink_items in batches.items():
                sink.deliver(sink_items)
            continue
        try:
            loop.call_soon_threadsafe(deliver_all, list(batches.items()))
        except RuntimeError:  # the loop is closed
            for sink_items in batches.values():
                orphans += [i.request_id for i in sink_items if sinks.pop(i.request_id, None)]
    return orphans


class RequestStream(OutputSink):
    """Outputs of one request in order; ends after the output with ``finished=True``.

    Iterate with ``for`` (blocking) when created by ``add_request``, with ``async for`` when
    created by ``add_request_async``. Cancelling an ``async for`` aborts the request.
    """

    def __init__(
        self,
        request_id: str,
        abort: Callable[[str], bool],
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.request_id = request_id
        self._abort = abort
        self.loop = loop
        self._sync: queue.SimpleQueue[StreamItem] | None = None
        self._async: asyncio.Queue[StreamItem] | None = None
        if loop is None:
            self._sync = queue.SimpleQueue()
        else:
            self._async = asyncio.Queue()
        self._done = False

    def deliver(self, items: list[StreamItem]) -> None:
        put = self._sync.put if self._sync is not None else self._async.put_nowait  # type: ignore[union-attr]
        for item in items:
            put(item)

    def _unwrap(self, item: StreamItem) -> RequestOutput:
        if isinstance(item, StreamEnd):
            self._done = True
            raise item.error
        self._done = item.finished
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._sync is None:
            raise TypeError("this stream was created by add_request_async: use `async for`")
        while not self._done:
            yield self._unwrap(self._sync.get())

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._async is None:
            raise TypeError("this stream was created by add_request: use `for`")
        try:
            while not self._done:
                yield self._unwrap(await self._async.get())
        except (asyncio.CancelledError, GeneratorExit):
            if not self._done:
                self.abort()
            raise

    def abort(self) -> bool:
        return self._abort(self.request_id)

    def collect(self) -> GenerationResult:
        """Block until the request finishes; the accumulated result."""
        result = GenerationResult(self.request_id, [])
        for out in self:
            result.add(out)
        return result

    async def acollect(self) -> GenerationResult:
        result = GenerationResult(self.request_id, [])
        async for out in self:
            result.add(out)
        return result
