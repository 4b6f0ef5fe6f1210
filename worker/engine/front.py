"""Streaming front: the engine's step loop in its own thread, per-request output streams.

Any thread may call :meth:`StreamingEngine.add_request` / ``abort``; asyncio code calls
:meth:`StreamingEngine.add_request_async` and iterates with ``async for``. The engine itself
stays single-threaded: every call into it holds one lock, and the engine thread holds that
lock for a whole step. Validation errors (``InvalidRequest``) and ``EngineOverloaded`` are
raised in the caller's thread, before anything is queued.

The worker actor wraps this class; ``on_step`` is its hook to drain KV events and publish load
after every step, ``on_death`` its hook for a loop that died (the engine failed in a way it
could not contain; one request's failure never does that): every stream then ends with the
error, new requests are refused, and the worker takes itself down to be restarted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvstore.blocks.errors import EngineStopped
from kvstore.blocks.outputs import GenerationResult, RequestOutput
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine.engine import Engine
from worker.engine.intake import Prompt
from worker.engine.metrics import EngineMetrics
from worker.kv import BlockKey

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestStream:
    """Outputs of one request in order; ends after the output with ``finished=True``.

    Iterate with ``for`` (blocking) when created by ``add_request``, with ``async for`` when
    created by ``add_request_async``. Cancelling an ``async for`` aborts the request.
    """

    def __init__(
        self, request_id: str, front: StreamingEngine, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.request_id = request_id
        self._front = front
        self._loop = loop
        self._sync: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self._async: asyncio.Queue[RequestOutput | BaseException] | None = (
            asyncio.Queue() if loop is not None else None
        )
        self._done = False

    # called by the engine thread
    def _put(self, item: RequestOutput | BaseException) -> bool:
        """Deliver; False if the consumer's event loop is gone (the caller aborts)."""
        if self._async is None:
            self._sync.put(item)
            return True
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)  # type: ignore[union-attr]
        except RuntimeError:  # loop closed
            return False
        return True

    def _unwrap(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._async is not None:
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
        return self._front.abort(self.request_id)

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


class StreamingEngine:
    """Runs ``engine.step()`` in a background thread and fans outputs out to streams."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 0.5,
    ) -> None:
        """``on_step(engine, outputs)`` runs in the engine thread after every step, with the
        engine lock held: it may read the engine (drain KV events, metrics) but must not call
        this front; if it raises, the error is logged and the loop goes on. ``on_death(exc)``
        runs in the engine thread once, after the loop died and every stream was ended."""
        self.engine = engine
        self._on_step = on_step
        self._on_death = on_death
        self._idle_wait = idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what killed the loop, if anything
        if engine.grammars is not None:  # a finished grammar compile wakes the loop
            engine.grammars.on_ready = self._wake.set

    def start(self) -> StreamingEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is left, end every stream, join the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            leftovers = self.engine.step() if self.engine.has_unfinished_requests() else []
        self._dispatch(leftovers)
        for stream in list(self._streams.values()):
            stream._put(EngineStopped("the engine was stopped"))
        self._streams.clear()

    def __enter__(self) -> StreamingEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request from any thread; iterate the returned stream with ``for``."""
        return self._add(prompt, params, request_id, None)

    async def add_request_async(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_keys: Sequence[BlockKey] | None = None,
    ) -> RequestStream:
        """Queue a request from asyncio code; iterate the returned stream with ``async for``.
        ``prompt_keys``: see :meth:`Engine.add_request`."""
        return self._add(prompt, params, request_id, asyncio.get_running_loop(), prompt_keys)

    def _add(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        loop: asyncio.AbstractEventLoop | None,
        prompt_keys: Sequence[BlockKey] | None = None,
    ) -> RequestStream:
        with self._lock:  # checked under the lock: a dying loop takes the streams under it
            if self.error is not None:
                raise EngineStopped(f"the engine loop died: {self.error!r}")
            if self._stopping or self._thread is None:
                raise EngineStopped("the streaming engine is not running (call start())")
            rid = self.engine.add_request(
                prompt, params, request_id=request_id, prompt_keys=prompt_keys
            )
            stream = self._streams[rid] = RequestStream(rid, self, loop)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        with self._lock:
            found = self.engine.abort(request_id)
        self._wake.set()
        return found

    def metrics(self) -> EngineMetrics:
        return self.with_engine(Engine.metrics)

    def with_engine(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` under the engine lock (between steps)."""
        with self._lock:
            return fn(self.engine)

    # ---- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    if busy and self._on_step is not None:
                        self._hook(outputs)
                    compiling = busy and not outputs and self.engine.idle_on_grammars()
                self._dispatch(outputs)
                if not busy or compiling:
                    self._wake.wait(self._idle_wait)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting stream
            log.exception("engine loop died")
            self.error = exc
            self._stopping = True
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream._put(EngineStopped(f"the engine loop died: {exc!r}"))
            if self._on_death is not None:
                self._on_death(exc)

    @property
    def alive(self) -> bool:
        """The loop runs (or was never started); False once it died."""
        return self.error is None

    def _hook(self, outputs: list[RequestOutput]) -> None:
        try:
            self._on_step(self.engine, outputs)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - publishing/telemetry must not stop the engine
            log.exception("on_step hook failed; the engine goes on")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        gone: list[str] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)
            if not stream._put(out) and not out.finished:
                gone.append(out.request_id)
        for rid in gone:
            self._streams.pop(rid, None)
            self.abort(rid)

    def __repr__(self) -> str:
        state: Any = "running" if self._thread is not None else "stopped"
        return f"StreamingEngine({state}, streams={len(self._streams)})"
