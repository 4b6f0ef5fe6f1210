"""Streaming front: the engine's step loop in its own thread, fed through a queue.

The engine stays single-threaded and its thread owns it. Adds, aborts and calls
(:meth:`StreamingEngine.with_engine`) from any thread go into an inbox that the engine thread
drains between steps (as vLLM's ``EngineCore.run_busy_loop`` does); nobody else takes the
engine's lock while the loop runs, so no caller waits for a step to end before its command is
queued, and asyncio callers await a future instead of blocking their loop. A request is
checked against the engine's fixed facts (limits, KV size, config) in the caller's thread
before it is queued, so ``InvalidRequest`` comes back at once; a duplicate id or a full
waiting queue (``EngineOverloaded``) is found when the engine thread takes the request in,
and raised to the caller from there.

Outputs leave once per step: the engine thread groups them by sink (``streams.py``) and
hands each event loop one batch per step.

The worker actor wraps this class; ``on_step`` is its hook to drain KV events and publish load
after every step, ``on_death`` its hook for a loop that died (the engine failed in a way it
could not contain; one request's failure never does that): every stream then ends with the
error, new requests are refused, and the worker takes itself down to be restarted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvstore.blocks.errors import EngineStopped
from kvstore.blocks.loop_sched import ThreadSchedConfig, demote_compute
from kvstore.blocks.outputs import RequestOutput
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine.burst import BurstAdmission, refuser
from worker.engine.engine import Engine
from worker.engine.engine_calls import EngineCalls
from worker.engine.inbox import Command, Inbox
from worker.engine.intake import Prompt
from worker.engine.streams import OutputSink, RequestStream, StreamEnd, StreamItem, dispatch
from worker.engine.window import ForwardWindow
from worker.kv import BlockKey
from worker.model.cpu_threads import configure_threads

log = logging.getLogger(__name__)


class StreamingEngine(BurstAdmission, EngineCalls):
    """Runs ``engine.step()`` in a background thread; commands reach it through a queue.
    A burst of requests goes in with :meth:`add_requests_async` (``burst.py``); calls on the
    engine between steps, :meth:`with_engine` and its kin (``engine_calls.py``)."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 0.5,
        sched: ThreadSchedConfig | None = None,
    ) -> None:
        """``on_step(engine, outputs)`` runs in the engine thread after every step: it may
        read the engine (drain KV events, metrics) but must not block on this front's
        queue; if it raises, the error is logged and the loop goes on. ``on_death(exc)`` runs
        in the engine thread once, after the loop died and every stream was ended.
        ``sched``: the engine thread (on CPU) demotes itself and its compute threads
        (``kvstore/blocks/loop_sched.py``); None: it runs as it was started."""
        self.engine = engine
        self._sched = sched
        self.compute_nice: int | None = None  # the engine thread's niceness once demoted
        self._on_step = on_step
        self._on_death = on_death
        self._idle_wait = idle_wait_s
        self._lock = threading.Lock()  # held by whoever runs the engine (thread or stop())
        # held with _lock, lent to exports while the model runs (always taken after _lock)
        self.window = engine.window = ForwardWindow()
        self._wake = threading.Event()
        self._inbox = Inbox(self._wake)  # commands, run by the engine thread
        self._sinks: dict[str, OutputSink] = {}  # live requests -> sink (engine thread only)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what killed the loop, if anything
        self.steps = 0  # steps run by the loop (with or without model work)
        self.busy_s = 0.0  # time the loop spent on commands, steps and the step hook
        if engine.grammars is not None:  # a finished grammar compile wakes the loop
            engine.grammars.on_ready = self._wake.set

    def start(self) -> StreamingEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._inbox.open()
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort what is left, end every stream, join the thread."""
        self._inbox.close()
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock, self.window.held():
            self._inbox.drain()  # what was queued before the door closed
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            leftovers = self.engine.step() if self.engine.has_unfinished_requests() else []
        self._dispatch(leftovers)
        self._end_all(EngineStopped("the engine was stopped"))

    def __enter__(self) -> StreamingEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_keys: Sequence[BlockKey] | None = None,
        sink: OutputSink | None = None,
    ) -> RequestStream | None:
        """Queue a request from any thread and wait until the engine took it in (at most
        one step); iterate the returned stream with ``for``. With ``sink`` the outputs go
        there instead and None is returned."""
        return self.submit_request(prompt, params, request_id, prompt_keys, sink).result()

    async def add_request_async(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_keys: Sequence[BlockKey] | None = None,
        sink: OutputSink | None = None,
    ) -> RequestStream | None:
        """Queue a request from asyncio code; iterate the returned stream with ``async for``
        (or, with ``sink``, get None: the outputs go to the sink). The loop never waits: the
        call awaits the engine thread's answer. ``prompt_keys``: see
        :meth:`Engine.add_request`."""
        loop = asyncio.get_running_loop()
        future = self.submit_request(prompt, params, request_id, prompt_keys, sink, loop)
        return await asyncio.wrap_future(future)

    def submit_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        prompt_keys: Sequence[BlockKey] | None,
        sink: OutputSink | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Future[RequestStream | None]:
        """Check the request here, queue it; the future ends when the engine took it in
        (its result: the request's stream, or None with ``sink``). Raises InvalidRequest
        and EngineStopped at once; the future raises InvalidRequest (a duplicate id) and
        EngineOverloaded."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        prompt_ids = self.engine.check_request(prompt, params)
        stream = RequestStream(rid, self.abort, loop) if sink is None else None
        target: OutputSink = sink if sink is not None else stream  # type: ignore[assignment]
        future: Future[RequestStream | None] = Future()

        def add() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                self._take_in(rid, prompt_ids, params, prompt_keys, target)
            except Exception as exc:  # noqa: BLE001 - the caller's error, raised there
                future.set_exception(exc)
                return
            future.set_result(stream)

        self._inbox.submit(Command(add, refuser(future)))
        return future

    def abort(self, request_id: str) -> bool:
        """Abort a request (applied between steps; its last output follows). Never waits:
        returns whether the request was live when asked."""
        live = request_id in self._sinks
        try:
            self._inbox.submit(Command(lambda: self.engine.abort(request_id) and None))
        except EngineStopped:
            return False
        return live

    # ---- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # before the first parallel region: this thread's OpenMP team and the attention
            # pool's threads (made anew) inherit the niceness
            if self._sched is not None:
                self.compute_nice = demote_compute(self._sched, self.engine.config.device)
            # OpenMP's team size is per thread: this one starts from OMP_NUM_THREADS, not
            # from what the thread that built the engine set (worker/model/cpu_threads.py)
            configure_threads(self.engine.cpu_threads, fresh_pool=self.compute_nice is not None)
            while not self._stopping:
                self._wake.clear()
                t0 = time.perf_counter()
                with self._lock, self.window.held():
                    self._inbox.drain()
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    if busy:
                        self.steps += 1
                        if self._on_step is not None:
                            self._hook(outputs)
                    # only requests waiting for their grammar: sleep until a compile ends
                    compiling = busy and not outputs and self.engine.idle_on_grammars()
                self._dispatch(outputs)
                self.busy_s += time.perf_counter() - t0
                if (not busy or compiling) and not self._inbox:
                    self._wake.wait(self._idle_wait)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting stream
            log.exception("engine loop died")
            self.error = exc
            self._stopping = True
            died = f"the engine loop died: {exc!r}"
            self._inbox.close(died)
            with self._lock, self.window.held():
                self._inbox.fail(EngineStopped(died))
            self._end_all(EngineStopped(died))
            if self._on_death is not None:
                self._on_death(exc)

    @property
    def thread_id(self) -> int | None:
        """The engine thread's OS id while it runs (its scheduling is read by it)."""
        thread = self._thread
        return thread.native_id if thread is not None and thread.is_alive() else None

    @property
    def alive(self) -> bool:
        """The loop runs (or was never started); False once it died."""
        return self.error is None

    def _hook(self, outputs: list[RequestOutput]) -> None:
        try:
            self._on_step(self.engine, outputs)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - publishing/telemetry must not stop the engine
            log.exception("on_step hook failed; the engine goes on")

    def _dispatch(self, items: Sequence[StreamItem]) -> None:
        """Hand this step's items to their sinks: one call per event loop."""
        for rid in dispatch(self._sinks, items):  # their loop is closed: nobody reads them
            self.abort(rid)

    def _end_all(self, exc: BaseException) -> None:
        """End every open stream with ``exc`` (the engine stopped or died)."""
        self._dispatch([StreamEnd(rid, exc) for rid in list(self._sinks)])

    def __repr__(self) -> str:
        state: Any = "running" if self._thread is not None else "stopped"
        return f"StreamingEngine({state}, streams={len(self._sinks)})"
