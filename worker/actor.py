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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from kvstore.blocks.loop_sched import ThreadSchedConfig, apply_loop_policy, thread_sched
from kvstore.blocks.looplag import LoopLagProbe
from kvstore.blocks.outputs import OUTPUT_SCHEMA
from kvstore.blocks.pauses import WarmUpFreeze, freeze_long_lived, short_gil_turns
from kvstore.blocks.protocol import (
    Admitted,
    PullReport,
    WorkerRequest,
    WorkerStatus,
)
from kvstore.blocks.wire import check_schema
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from kvstore.publisher import WorkerPublisher
from worker.burst_intake import BurstIntake
from worker.callers import CallerWatch
from worker.channel_calls import ChannelCalls
from worker.channels import Channels
from worker.engine import Engine, EngineConfig, RequestOutput
from worker.engine.front import StreamingEngine
from worker.index_hooks import IndexHooks
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


class WorkerServer(PeerPulls, BurstIntake, IndexHooks, ChannelCalls):
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
            # what the engine holds from the start (a disk tier's runs) is announced under
            # this epoch right after registering, before the first request
            held = self.front.with_engine(lambda engine: engine.drain_kv_events())
            self.publisher.submit(held, worker_load(self.engine.snapshot()))
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
