"""The engine loop: the engine's step loop in its own thread, fed typed commands.

The engine stays single-threaded and this loop's thread owns it. Other threads queue
commands (``commands.py``: adds, bursts of adds, aborts and named calls) in the loop's inbox;
the engine thread drains it between steps (as vLLM's ``EngineCore.run_busy_loop`` does) and
:meth:`EngineLoop._execute` dispatches each. Nobody else takes the engine's lock while the
loop runs, so no caller waits for a step to end before its command is queued, and asyncio
callers await a future instead of blocking their loop. A request is checked against the
engine's fixed facts (limits, KV size, config) in the caller's thread before it is queued, so
``InvalidRequest`` comes back at once; a duplicate id or a full waiting queue
(``EngineOverloaded``) is found when the engine thread takes the request in, and raised to
the caller from there.

A burst of requests (one router loop turn's, :meth:`add_requests_async`) is checked on the
caller's loop in turns of ``LOOP_SLICE_S`` (``kvstore/runtime/pauses.py``) and taken in with
one command and one answer: added one by one, 128 requests would cost the caller's loop 128
checks back to back and 128 futures completing together.

Outputs leave once per step: the engine thread groups them by sink (``streams.py``) and
hands each event loop one batch per step.

The worker server wraps this class; ``on_step`` is its hook to drain KV events and publish
load after every step, ``on_death`` its hook for a loop that died (the engine failed in a
way it could not contain; one request's failure never does that): every stream then ends
with the error, new requests are refused, and the worker takes itself down to be restarted.

Tests read the engine through a command (:class:`~worker.engine.commands.Snapshot`, ...) or
the test hook :meth:`EngineLoop.paused`, which parks the loop between two steps and hands
the engine to the calling thread until the block ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch

from kvstore.blocks.tiers import Tier
from kvstore.requests.errors import EngineStopped
from kvstore.requests.outputs import RequestOutput
from kvstore.requests.sampling_params import SamplingParams
from kvstore.runtime.loop_sched import ThreadSchedConfig, demote_compute
from kvstore.runtime.pauses import LoopSlices
from worker.engine.commands import (
    ADDS,
    Abort,
    AddBurst,
    AddLora,
    AddRequest,
    AnnounceState,
    CachedKeys,
    Command,
    ComputeThreads,
    DrainEvents,
    ExportRun,
    ImportRun,
    Metrics,
    Pause,
    RemoveLora,
    ResetPrefixCache,
    SetSpares,
    Snapshot,
)
from worker.engine.engine import Engine
from worker.engine.forward_window import ForwardWindow
from worker.engine.inbox import Inbox
from worker.engine.intake import Prompt
from worker.engine.kv_pull import export_run, import_run
from worker.engine.streams import OutputSink, RequestStream, StreamEnd, StreamItem, dispatch
from worker.kv import BlockKey
from worker.model.thread_count import configure_threads

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs ``engine.step()`` in a background thread; commands reach it through its inbox."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 0.5,
        sched: ThreadSchedConfig | None = None,
    ) -> None:
        """``on_step(engine, outputs)`` runs in the engine thread after every step (and for
        :class:`AnnounceState`): it may read the engine (drain KV events, metrics) but must
        not wait on this loop; if it raises, the error is logged and the loop goes on.
        ``on_death(exc)`` runs in the engine thread once, after the loop died and every
        stream was ended. ``sched``: the engine thread (on CPU) demotes itself and its
        compute threads (``kvstore/runtime/loop_sched.py``); None: it runs as started."""
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

    def start(self) -> EngineLoop:
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
            for command, future in self._inbox.drain():  # queued before the door closed
                self._answer(command, future)
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            leftovers = self.engine.step() if self.engine.has_unfinished_requests() else []
        self._dispatch(leftovers)
        self._end_all(EngineStopped("the engine was stopped"))

    def __enter__(self) -> EngineLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- requests ------------------------------------------------------------------------

    def check(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_keys: Sequence[BlockKey] | None = None,
        sink: OutputSink,
    ) -> AddRequest:
        """The :class:`AddRequest` for a request checked here, in the caller's thread (a
        text prompt is tokenized); raises InvalidRequest."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        prompt_ids = self.engine.check_request(prompt, params)
        return AddRequest(rid, prompt_ids, params, prompt_keys, sink)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_keys: Sequence[BlockKey] | None = None,
    ) -> RequestStream:
        """Queue a request from any thread and wait until the engine took it in (at most
        one step); iterate the returned stream with ``for``."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = RequestStream(rid, self.abort, None)
        add = self.check(prompt, params, request_id=rid, prompt_keys=prompt_keys, sink=stream)
        self._submit(add).result()
        return stream

    async def add_request_async(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_keys: Sequence[BlockKey] | None = None,
    ) -> RequestStream:
        """Queue a request from asyncio code; iterate the returned stream with ``async for``.
        The loop never waits: the call awaits the engine thread's answer. ``prompt_keys``:
        see :meth:`Engine.add_request`."""
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = RequestStream(rid, self.abort, asyncio.get_running_loop())
        add = self.check(prompt, params, request_id=rid, prompt_keys=prompt_keys, sink=stream)
        await self.add_async(add)
        return stream

    async def add_async(self, add: AddRequest) -> None:
        """Queue a request checked by :meth:`check` from asyncio code (its outputs go to
        its sink); returns once the engine took it in. Raises EngineStopped at once,
        InvalidRequest (a duplicate id) and EngineOverloaded from the engine thread."""
        await asyncio.wrap_future(self._submit(add))

    async def add_requests_async(
        self, requests: Sequence[AddRequest], slices: LoopSlices | None = None
    ) -> list[Exception | None]:
        """Queue a burst from asyncio code (prompts of token ids, checked here); per request,
        in order: None once the engine took it in, or the error that refused it
        (InvalidRequest from the check here or for a duplicate id, EngineOverloaded,
        EngineStopped). The loop never waits for a step and is given back every
        ``slices.budget_s`` while the requests are checked."""
        slices = slices or LoopSlices()
        results: list[Exception | None] = [None] * len(requests)
        checked: list[int] = []  # positions of the requests that passed the check
        for i, add in enumerate(requests):
            try:
                self.engine.check_request(add.prompt_ids, add.params)
            except Exception as exc:  # noqa: BLE001 - this request's answer, not the burst's
                results[i] = exc
            else:
                checked.append(i)
            await slices.tick()
        if not checked:
            return results
        burst = AddBurst(tuple(requests[i] for i in checked))
        try:
            errors = await asyncio.wrap_future(self._submit(burst))
        except EngineStopped as exc:
            errors = dict.fromkeys(range(len(checked)), exc)
        for j, exc in errors.items():
            results[checked[j]] = exc
        return results

    def _submit(self, add: AddRequest | AddBurst) -> Future:
        """Queue an add; raises EngineStopped at once when the loop is not running."""
        future: Future = Future()
        self._inbox.submit(add, future)
        return future

    def abort(self, request_id: str) -> bool:
        """Abort a request (applied between steps; its last output follows). Never waits:
        returns whether the request was live when asked."""
        live = request_id in self._sinks
        try:
            self._inbox.submit(Abort(request_id))
        except EngineStopped:
            return False
        return live

    # ---- named calls ---------------------------------------------------------------------

    def call(self, command: Command) -> Any:
        """Run ``command`` between steps and return its answer; blocks the calling thread
        (up to one step) while the loop runs. From asyncio code use :meth:`call_async`."""
        if threading.current_thread() is self._thread:
            return self._execute(command)
        future = self.post(command)
        if future is None:  # no loop to ask: the engine is the caller's to read
            with self._lock, self.window.held():
                return self._execute(command)
        return future.result()

    async def call_async(self, command: Command) -> Any:
        """:meth:`call` for asyncio code: awaits, never blocks the loop."""
        future = self.post(command)
        if future is None:
            with self._lock, self.window.held():
                return self._execute(command)
        return await asyncio.wrap_future(future)

    def post(self, command: Command) -> Future | None:
        """Queue ``command`` from any thread without waiting; the future of its answer (an
        exception in it is the future's, never the loop's), None when the loop is stopped."""
        future: Future = Future()
        try:
            self._inbox.submit(command, future)
        except EngineStopped:
            return None
        return future

    async def export_async(self, command: ExportRun, timeout_s: float) -> Any:
        """Run an export in a helper thread as soon as the engine is idle or computing a
        forward (``window.py``), not after the step in flight. TimeoutError after
        ``timeout_s``."""
        return await asyncio.to_thread(self.window.run, lambda: self._execute(command), timeout_s)

    @contextmanager
    def paused(self) -> Iterator[Engine]:
        """Test hook: park the loop between two steps and hand the engine to the calling
        thread until the block ends (with no loop running, the caller takes the engine's
        lock). Blocks the caller for up to one step; never for asyncio code."""
        parked, resume = threading.Event(), threading.Event()
        if self.post(Pause(parked, resume)) is None:
            with self._lock, self.window.held():
                yield self.engine
            return
        parked.wait()
        try:
            yield self.engine
        finally:
            resume.set()

    # ---- the loop ------------------------------------------------------------------------

    def _execute(self, command: Command) -> Any:
        """Run one command on the engine (the engine thread, or a caller holding the lock)."""
        engine = self.engine
        match command:
            case AddRequest():
                self._take_in(command)
                return None
            case AddBurst(requests):
                errors: dict[int, Exception] = {}
                for i, add in enumerate(requests):
                    try:
                        self._take_in(add)
                    except Exception as exc:  # noqa: BLE001 - the caller's error, raised there
                        errors[i] = exc
                return errors
            case Abort(request_id):
                return engine.abort(request_id)
            case Snapshot(pins_max_age_s):
                return engine.snapshot(pins_max_age_s=pins_max_age_s)
            case Metrics():
                return engine.metrics()
            case AddLora(name, path, tenants):
                return engine.add_lora(name, path, tenants)
            case RemoveLora(name):
                return engine.remove_lora(name)
            case ResetPrefixCache():
                return engine.kv.reset_prefix_cache()
            case DrainEvents():
                return engine.drain_kv_events()
            case ImportRun(run, token_ids, ctx, keys):
                return import_run(engine, run, token_ids, ctx, keys)
            case ExportRun(keys, ctx, start):
                return export_run(engine, list(keys), ctx, start)
            case SetSpares(keys):
                t0 = time.monotonic()
                engine.kv.set_spares(keys)
                return time.monotonic() - t0
            case CachedKeys(mark):
                if mark is not None:
                    mark()
                kv = engine.kv
                return {Tier.DEVICE: kv.cached_keys()} | {
                    b.tier: b.keys() for b in kv.tiers.backends
                }
            case AnnounceState():
                if self._on_step is not None:
                    self._hook([])
                return None
            case ComputeThreads():
                return torch.get_num_threads()
            case Pause(parked, resume):
                parked.set()
                resume.wait()
                return None
        raise AssertionError(f"not an engine command: {command!r}")

    def _take_in(self, add: AddRequest) -> None:
        """Engine thread: add a checked request and send its outputs to its sink."""
        self.engine.add_checked(
            add.request_id, add.prompt_ids, add.params, add.prompt_keys, add.continued
        )
        self._sinks[add.request_id] = add.sink

    def _answer(self, command: Command, future: Future | None) -> None:
        """Run a queued command and settle its future (a cancelled one is skipped)."""
        if future is None:  # an abort: nobody waits for it
            self._execute(command)
            return
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self._execute(command))
        except BaseException as exc:  # noqa: BLE001 - the caller's to see
            future.set_exception(exc)

    def _run(self) -> None:
        try:
            # before the first parallel region: this thread's OpenMP team and the attention
            # pool's threads (made anew) inherit the niceness
            if self._sched is not None:
                self.compute_nice = demote_compute(self._sched, self.engine.config.device)
            # OpenMP's team size is per thread: this one starts from OMP_NUM_THREADS, not
            # from what the thread that built the engine set (worker/model/thread_count.py)
            configure_threads(self.engine.cpu_threads, fresh_pool=self.compute_nice is not None)
            while not self._stopping:
                self._wake.clear()
                t0 = time.perf_counter()
                with self._lock, self.window.held():
                    if self._inbox:
                        for command, future in self._inbox.drain():
                            self._answer(command, future)
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
                self._refuse_queued(EngineStopped(died))
            self._end_all(EngineStopped(died))
            if self._on_death is not None:
                self._on_death(exc)

    def _refuse_queued(self, stopped: EngineStopped) -> None:
        """After a death: queued adds are refused with ``stopped``, queued calls still run
        (they read the engine; an abort finds its request gone with the streams)."""
        for command, future in self._inbox.drain():
            try:
                if isinstance(command, ADDS):
                    if future is not None and future.set_running_or_notify_cancel():
                        future.set_exception(stopped)
                else:
                    self._answer(command, future)
            except Exception:  # noqa: BLE001 - the engine is beyond repair
                log.exception("a queued command failed after the engine loop died")

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread (None before start and after stop)."""
        return self._thread

    @property
    def thread_id(self) -> int | None:
        """The engine thread's OS id while it runs (its scheduling is read by it)."""
        thread = self._thread
        return thread.native_id if thread is not None and thread.is_alive() else None

    @property
    def alive(self) -> bool:
        """The loop runs (or was never started); False once it died."""
        return self.error is None

    def is_live(self, request_id: str) -> bool:
        """The request has an open stream here (taken in, its last output not yet sent)."""
        return request_id in self._sinks

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
        state = "running" if self._thread is not None else "stopped"
        return f"EngineLoop({state}, streams={len(self._sinks)})"
