"""The worker as a Ray actor: one engine (its step loop in its own thread), publishing KV
events and load to the Redis index after every step.

``WorkerServer`` is a plain class (tested without Ray); ``WorkerActor`` wraps it in one line.
No scheduling logic lives here: requests go to :class:`StreamingEngine` (whose queue the
engine thread drains between steps: no method here waits for a step on the actor's loop),
outputs leave through one channel per calling router (``channels.py``), KV events and load
go to :class:`WorkerPublisher`, whose thread is the only one that talks to Redis — the step
loop never waits on it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from kvstore.blocks.errors import UnknownChannel
from kvstore.blocks.loop_sched import ThreadSchedConfig, apply_loop_policy, thread_sched
from kvstore.blocks.looplag import LoopLagProbe
from kvstore.blocks.outputs import OUTPUT_SCHEMA, PackedOutput
from kvstore.blocks.pauses import WarmUpFreeze, freeze_long_lived, short_gil_turns
from kvstore.blocks.protocol import (
    Admitted,
    PullReport,
    WorkerRequest,
    WorkerStatus,
)
from kvstore.blocks.wire import check_schema
from kvstore.config import IndexConfig
from kvstore.events import TierKeys
from kvstore.index import KVIndex
from kvstore.index_sync import SPARES_DUTY
from kvstore.publisher import WorkerPublisher
from worker.burst_intake import BurstIntake
from worker.callers import CallerWatch
from worker.channels import Channel, Channels
from worker.engine import Engine, EngineConfig, RequestOutput
from worker.engine.front import StreamingEngine
from worker.engine.streams import StreamEnd
from worker.kv import block_keys
from worker.lifecycle import exit_process_soon, in_ray_actor
from worker.live_ids import LiveIds
from worker.model.default_model import resolve_default_model
from worker.pull.peer import PeerPulls
from worker.status import worker_load, worker_status
from worker.telemetry import WorkerTelemetry

log = logging.getLogger(__name__)

# the load published after each step may carry a waiting-pinned count this old (seconds):
# recounting is O(waiting prompt blocks) on the engine thread, the index hears the load at
# heartbeat cadence, and an empty queue reports 0 at once
PINS_MAX_AGE_S = 0.05


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Everything one worker needs (built by the launcher)."""

    worker_id: str  # registry id and Ray actor name, e.g. "worker-0"
    model_dir: str | None  # Hugging Face folder; None: the default model, resolved here
    model_id: str  # folded into block keys; the routers' and the index's too
    engine: EngineConfig  # block size, KV size, limits, policy
    index: IndexConfig | None  # None: do not publish (no Redis)
    default_family: str = "llama"  # family of the default model (model_dir None)
    sched: ThreadSchedConfig = ThreadSchedConfig()  # the loop's slice, the engine's niceness
    # Ray namespace of the cluster's actors, where peers are looked up (None: the job's own;
    # a cluster sharing a driver's Ray has a namespace other than the job's)
    namespace: str | None = None


class WorkerServer(PeerPulls, BurstIntake):
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.namespace = settings.namespace
        # the default model is resolved on this worker's node, never sent as a head's path
        self.model_dir = settings.model_dir or str(resolve_default_model(settings.default_family))
        self.engine = Engine.from_model_dir(
            self.model_dir, settings.engine, model_id=settings.model_id
        )
        self.publisher: WorkerPublisher | None = None
        self._spares_after = 0.0  # monotonic time before which a spares refresh is dropped
        if settings.index is not None:
            index = KVIndex(settings.index)
            self.publisher = WorkerPublisher(
                index,
                self.worker_id,
                self._cached_keys,
                address=f"pid:{os.getpid()}",
                on_spares=self._set_spares,
            )
        self.telemetry = WorkerTelemetry(self.worker_id)
        self.telemetry.start_heartbeat()
        self._in_actor = in_ray_actor()  # asked here: the engine thread reports a death
        self.front = StreamingEngine(
            self.engine, on_step=self._after_step, on_death=self._engine_died, sched=settings.sched
        )
        self.front.start()
        self._init_pulls()
        self.callers = CallerWatch(self.front.abort, on_dead=self._caller_died)
        self.live = LiveIds()  # a second request with a live id is refused, the first unharmed
        self.channels = Channels(
            self.front.abort, self._stream_ended, on_drop=self.callers.forget_channel
        )
        self.loop_probe = LoopLagProbe()
        if self.publisher is not None:
            self.publisher.submit([], worker_load(self.engine.snapshot()))
            self.publisher.start()
        # the loop answers in a few ms next to the engine thread: short GIL turns, and no
        # collection scans the start-up heap (the engine froze the model's; this is ours)
        short_gil_turns()
        freeze_long_lived()
        self.warm_freeze = WarmUpFreeze()  # and once more when idle after the first requests
        self._loop_sched = False  # the loop's thread asked for its slice (on its first call)

    # -- engine thread hooks ---------------------------------------------------------------

    def _after_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        events = engine.drain_kv_events()
        # one snapshot: the load published and the gauges agree; its pinned-block count is
        # recounted at most every PINS_MAX_AGE_S (the publisher heartbeats less often)
        snap = engine.snapshot(pins_max_age_s=PINS_MAX_AGE_S)
        if self.publisher is not None:
            self.publisher.submit(events, worker_load(snap))
        self.telemetry.after_step(snap, outputs)

    def _engine_died(self, exc: BaseException) -> None:
        """The loop died (the engine could not contain an error): this worker is useless.
        Stop the heartbeat and deregister (routers drop it at once), then end the process so
        that Ray restarts the actor (``max_restarts``) with a fresh engine and a new epoch."""
        log.critical("worker %s: engine loop died (%r); leaving for a restart", self.worker_id, exc)
        # the exit is armed first: a clean-up step that raises or blocks (Redis unreachable)
        # must not leave the process up with a dead loop
        exit_process_soon(self._in_actor)
        try:
            self.telemetry.stop_heartbeat()
            if self.publisher is not None:
                self.publisher.stop(timeout_s=0.5)
        except Exception:  # noqa: BLE001 - best effort: the process is leaving anyway
            log.exception("worker %s: clean-up before the restart failed", self.worker_id)

    def _set_spares(self, spare: set) -> None:
        """From the publisher's thread: the keys another worker keeps, evicted first here
        (fleet-aware eviction), applied between steps. Classifying is O(cached blocks) on the
        engine thread, so a refresh is dropped until 20 times the last one's duration has
        passed (at most 5 % of the engine's time, whatever the pool's size)."""
        if time.monotonic() < self._spares_after:
            return

        def apply(engine: Engine) -> None:
            t0 = time.monotonic()
            try:
                engine.kv.set_spares(spare)
            finally:
                now = time.monotonic()
                self._spares_after = now + SPARES_DUTY * (now - t0)

        self._spares_after = float("inf")  # one in flight at a time
        if not self.front.post(apply):
            self._spares_after = 0.0

    def _cached_keys(self) -> list:
        """For a resync: the pool's cached keys, read between steps. Under the engine lock,
        where ``_after_step`` submits, so the publisher learns exactly which submitted events
        the snapshot already holds (``mark_snapshot``) and does not replay them on it."""

        def snapshot(engine: Engine) -> list:
            if self.publisher is not None:
                self.publisher.mark_snapshot()
            if engine.kv.has_host_tier:
                return TierKeys(engine.kv.cached_keys(), engine.kv.host_cached_keys())
            return engine.kv.cached_keys()

        return self.front.with_engine(snapshot)

    # -- API (called by routers through Ray) -----------------------------------------------

    async def ready(self) -> str:
        self._on_loop()
        return self.worker_id

    def _on_loop(self) -> None:
        """On the actor's event loop (Ray builds the actor on another thread): its thread's
        scheduling policy, once; by the launcher's ``ready`` and by every channel opened (a
        worker Ray restarted gets a new one from each router before its first request)."""
        if not self._loop_sched:
            self._loop_sched = True
            apply_loop_policy(self.settings.sched)

    async def submit(self, request: WorkerRequest, caller: Any, channel_id: str) -> Admitted:
        """Queue ``request``; its outputs go to the caller's channel ``channel_id`` (read
        with :meth:`outputs`). Raises InvalidRequest / EngineOverloaded.

        ``caller``: the calling router's :class:`CallerRef`; if it dies, the request is
        aborted. A channel's first requests carry it, later ones only its incarnation id
        (the worker keeps the ref with the channel: an actor handle costs to unpickle);
        :class:`UnknownChannel` if the channel has no such caller here (this worker was
        restarted since the router opened it). None: no caller to watch.

        A burst of one: :meth:`submit_many` does the work.
        """
        (result,) = await self.submit_many([request], caller, channel_id)
        if isinstance(result, Exception):
            raise result
        return result

    def _submit_channel(self, channel_id: str, caller: Any) -> Channel:
        """The channel a submit names: a router sends only its caller's incarnation id
        once a request with the ref came back admitted (UnknownChannel if not this one)."""
        if isinstance(caller, str):
            ch = self.channels.find(channel_id)
            known = None if ch is None else ch.caller
            if getattr(known, "incarnation", None) != caller:
                raise UnknownChannel(f"output channel {channel_id!r} is not open on this worker")
            return ch  # type: ignore[return-value]
        return self._channel(channel_id, caller)

    async def outputs(
        self, channel_id: str, caller: Any = None, schema: str | None = None
    ) -> AsyncIterator[list[PackedOutput | StreamEnd]]:
        """The channel's outputs, one list per message: every output of each request sent
        with this ``channel_id``, in order (packed: ``unpack_output``); a
        :class:`StreamEnd` ends a request whose engine stopped. Ends when the caller stops
        reading or dies, idle or not (its open requests are aborted).

        ``schema``: the caller's ``OUTPUT_SCHEMA``; a router of another packed layout is
        refused with :class:`WireMismatch`."""
        check_schema("output channel", schema, OUTPUT_SCHEMA)  # refused: nothing is opened
        if caller is not None:
            self._channel(channel_id, caller)
        async for items in self.channels.serve(channel_id, schema):
            yield items

    def _channel(self, channel_id: str, caller: Any) -> Channel:
        """The channel ``channel_id`` of ``caller``, watched while it is open."""
        ch = self.channels.get(channel_id)
        if ch.caller is None and caller is not None:
            ch.caller = caller
            self.callers.watch_channel(channel_id, caller)
            self._on_loop()
        return ch

    async def generate(
        self, request: WorkerRequest, caller: Any = None, schema: str | None = None
    ) -> AsyncIterator[Admitted | RequestOutput]:
        """One request's own stream (the fallback of :meth:`submit` + :meth:`outputs`):
        Admitted first, then the engine's outputs; raises InvalidRequest/EngineOverloaded.

        ``caller``: the calling router's actor handle; if it dies, the request is aborted.
        ``schema``: the caller's ``OUTPUT_SCHEMA`` (outputs nest positional types).
        """
        check_schema("output stream", schema, OUTPUT_SCHEMA)
        rid = request.request_id
        self.live.claim(rid)  # first: a duplicate id leaves the live request as it was
        try:
            self.telemetry.arrived(rid)
            keys = self._keys(request)
            pulled = await self._pull_for(request, keys)  # never raises: a failed pull recomputes
            stream = await self.front.add_request_async(
                request.token_ids, request.params, request_id=rid, prompt_keys=keys
            )
        except BaseException:
            self.live.release(rid)
            self.telemetry.forget(rid)
            raise
        assert stream is not None
        self.callers.watch(rid, caller)
        try:
            yield self._admitted(request, keys, pulled)
            async for out in stream:
                yield out
        finally:
            self._stream_ended(rid)

    def _keys(self, request: WorkerRequest) -> list:
        """The prompt's block keys, hashed once here and not by the engine thread: the
        scheduler's queue claims and the router's parity check use the same keys."""
        return block_keys(
            request.token_ids,
            self.engine.config.block_size,
            self.engine.hash_context(request.params),
        )

    def _admitted(
        self, request: WorkerRequest, keys: list, pulled: PullReport | None = None
    ) -> Admitted:
        epoch = self.publisher.epoch if self.publisher is not None else None
        last = keys[-1] if request.want_keys and keys else None
        return Admitted(self.worker_id, epoch, last, pulled)

    def _stream_ended(self, request_id: str) -> None:
        """A request's stream ended (its last output or StreamEnd was delivered)."""
        self.callers.forget(request_id)
        self.live.release(request_id)
        self.warm_freeze.request_ended(idle=not self.live)

    def _caller_died(self, caller: Any) -> None:
        """A dead router's channels have no reader any more."""
        for channel_id in self.channels.of_caller(caller):
            self.channels.drop(channel_id)

    def abort(self, request_id: str) -> bool:
        return self.front.abort(request_id)

    async def loop_lag(self, reset: bool = False, trace: bool = False) -> dict:
        """This actor's event-loop lag: the largest stall since the last reset (the probe
        starts on the first call); ``trace``: attribute stalls from now on (a diagnostic).
        ``engine_sched``: what the kernel runs the engine thread with, beside the loop's."""
        out = self.loop_probe.report(reset=reset, trace=trace)
        tid = self.front.thread_id
        if tid is not None:
            out["engine_sched"] = thread_sched(tid)
        return out

    def resync_index(self, reason: str) -> bool:
        """A router found this worker's index entries wrong (``reason``): replace them with
        the pool's cached keys. False when this worker publishes no index."""
        if self.publisher is None:
            return False
        log.warning("worker %s: resyncing its index entries: %s", self.worker_id, reason)
        self.publisher.request_resync()
        return True

    async def status(self) -> WorkerStatus:
        snap = await self.front.with_engine_async(Engine.snapshot)
        publisher = self.publisher
        return worker_status(
            self.worker_id,
            snap,
            epoch=publisher.epoch if publisher is not None else None,
            index_healthy=publisher.healthy if publisher is not None else False,
        )

    async def add_lora(self, name: str, path: str, tenants: list[str] | None = None) -> str:
        """Register a LoRA adapter folder at run time; returns its stable id. ``tenants``:
        the only tenants the routers show it to and run it for (None: every tenant). The
        next heartbeat tells the routers."""

        def add(engine: Engine) -> str:
            adapter_id = engine.add_lora(name, path, tenants)
            if self.publisher is not None:  # an idle worker publishes no step: tell now
                self.publisher.submit([], worker_load(engine.snapshot()))
            return adapter_id

        return await self.front.with_engine_async(add)

    async def kv_blocks_in_use(self) -> int:
        """Blocks with a reference (0 when idle: nothing leaked)."""
        return (await self.front.with_engine_async(Engine.snapshot)).kv_used_blocks

    def shutdown(self) -> None:
        self.telemetry.stop_heartbeat()
        self.front.stop()
        if self.publisher is not None:
            self.publisher.stop()


WorkerActor = ray.remote(WorkerServer)
