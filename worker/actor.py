"""The worker as a Ray actor: one engine (its step loop in its own thread), publishing KV
events and load to the Redis index after every step.

``WorkerServer`` is a plain class (tested without Ray); ``WorkerActor`` wraps it in one line.
No scheduling logic lives here. The server is made of its parts, each built here and handed
its collaborators: the engine loop (``worker/engine/engine_loop.py``: the engine's thread,
fed typed commands between steps, so no method here waits for a step on the actor's loop),
the intake (``burst_intake.py``: routers' bursts into the loop's adds), the outputs
(``worker_outputs.py``: one channel per calling router, the callers watched, the live ids),
the peers (``worker/pull/``: pulls, exports, warm starts) and the index link
(``index_link.py``: KV events and load to the publisher, whose thread is the only one that
talks to Redis; the step loop never waits on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from kvstore.adapter_registry import AdapterRegistry
from kvstore.blocks.hashing import BlockKey, HashContext
from kvstore.config import IndexConfig, make_client
from kvstore.requests.outputs import OUTPUT_SCHEMA, PackedOutput
from kvstore.requests.protocol import Admitted, WorkerRequest, WorkerStatus
from kvstore.requests.wire import check_schema
from kvstore.runtime.loop_sched import ThreadSchedConfig, apply_loop_policy, thread_sched
from kvstore.runtime.looplag import LoopLagProbe
from kvstore.runtime.pauses import freeze_long_lived, short_gil_turns
from worker.burst_intake import BurstIntake
from worker.engine import EngineConfig, RequestOutput
from worker.engine.commands import AddLora, AnnounceState, RemoveLora, Snapshot
from worker.engine.streams import StreamEnd
from worker.index_link import IndexLink
from worker.lifecycle import exit_process_soon, in_ray_actor
from worker.model.default_model import resolve_default_model
from worker.pull.peer import PeerPulls
from worker.pull.served_prefixes import HotPrefix
from worker.pull.transport import RunHandle
from worker.pull.warm import WarmStarts
from worker.registered_adapters import register_from_registry
from worker.status import worker_load, worker_status
from worker.telemetry import WorkerTelemetry
from worker.worker_outputs import WorkerOutputs

if TYPE_CHECKING:
    from worker.engine import Engine

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


class WorkerServer:
    """One worker: its engine, engine loop, intake, outputs, peers and index link."""

    def __init__(self, settings: WorkerSettings) -> None:
        # the engine (torch) is imported here, not at the top: routers import this module to
        # call workers (Ray unpickles the actor class) and never run an engine
        from worker.engine.engine import Engine
        from worker.engine.engine_loop import EngineLoop

        self.settings = settings
        self.worker_id = settings.worker_id
        t0 = time.monotonic()
        # the default model is resolved on this worker's node, never sent as a head's path
        self.model_dir = settings.model_dir or str(resolve_default_model(settings.default_family))
        self.engine = Engine.from_model_dir(
            self.model_dir, settings.engine, model_id=settings.model_id
        )
        self.model_load_s = time.monotonic() - t0  # its status reports it
        if settings.index is not None:
            self._register_cluster_adapters(settings.index)
        self.telemetry = WorkerTelemetry(self.worker_id, log_stats=settings.engine.log_stats)
        self.telemetry.start_heartbeat()
        self._in_actor = in_ray_actor()  # asked here: the engine thread reports a death
        self.engine_loop = EngineLoop(
            self.engine, on_step=self._after_step, on_death=self._engine_died, sched=settings.sched
        )
        self.index = IndexLink(settings.index, self.worker_id, self.engine_loop)
        self.engine_loop.start()
        self.pulls = PeerPulls(self.engine, self.engine_loop, self.worker_id, settings.namespace)
        self.warm = WarmStarts(self.engine, self.engine_loop, self.pulls)
        self.streams = WorkerOutputs(self.engine_loop.abort, self._on_loop)
        self.intake = BurstIntake(
            self.engine,
            self.engine_loop,
            self.streams,
            self.pulls,
            self.warm,
            self.telemetry,
            self.index,
        )
        self.loop_probe = LoopLagProbe()
        self.index.start(worker_load(self.engine.snapshot()))
        # the loop answers in a few ms next to the engine thread: short GIL turns, and no
        # collection scans the start-up heap (the engine froze the model's; this is ours)
        short_gil_turns()
        freeze_long_lived()
        self._loop_sched = False  # the loop's thread asked for its slice (on its first call)

    def _register_cluster_adapters(self, index: IndexConfig) -> None:
        """The adapters routers loaded at run time (``/v1/load_lora_adapter`` writes the
        registry), registered before the engine loop starts; never fails the start."""
        registry = AdapterRegistry(make_client(index), index.namespace)
        try:
            names = register_from_registry(self.engine, registry)
        finally:
            registry.close()
        if names:
            log.info("worker %s: LoRA adapters of the registry: %s", self.worker_id, names)

    # -- engine thread hooks ---------------------------------------------------------------

    def _after_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        events = engine.drain_kv_events()
        # one snapshot: the load published and the gauges agree; its pinned-block count is
        # recounted at most every PINS_MAX_AGE_S (the publisher heartbeats less often)
        snap = engine.snapshot(pins_max_age_s=PINS_MAX_AGE_S)
        self.index.publish(events, worker_load(snap))
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
            self.index.stop(timeout_s=0.5)
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
        (result,) = await self.intake.submit_many([request], caller, channel_id)
        if isinstance(result, Exception):
            raise result
        return result

    async def submit_many(
        self, requests: list[WorkerRequest], caller: Any, channel_id: str
    ) -> list[Admitted | Exception]:
        """One router loop turn's requests for this worker, each answered on its own, in
        order: its :class:`Admitted` or, in its place, the error that refused it (what
        :meth:`submit`, a burst of one, raises); see ``burst_intake.py``."""
        return await self.intake.submit_many(requests, caller, channel_id)

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
        async for items in self.streams.serve(channel_id, caller, schema):
            yield items

    def abort(self, request_id: str) -> bool:
        return self.engine_loop.abort(request_id)

    async def loop_lag(self, reset: bool = False, trace: bool = False) -> dict:
        """This actor's event-loop lag: the largest stall since the last reset (the probe
        starts on the first call); ``trace``: attribute stalls from now on (a diagnostic).
        ``engine_sched``: what the kernel runs the engine thread with, beside the loop's."""
        out = self.loop_probe.report(reset=reset, trace=trace)
        tid = self.engine_loop.thread_id
        if tid is not None:
            out["engine_sched"] = thread_sched(tid)
        return out

    async def status(self) -> WorkerStatus:
        snap = await self.engine_loop.call_async(Snapshot())
        return worker_status(
            self.worker_id,
            snap,
            epoch=self.index.epoch,
            index_healthy=self.index.healthy,
            model_load_s=self.model_load_s,
        )

    async def add_lora(self, name: str, path: str, tenants: list[str] | None = None) -> str:
        """Register a LoRA adapter folder at run time; returns its stable id. ``tenants``:
        the only tenants the routers show it to and run it for (None: every tenant). The
        next heartbeat tells the routers."""
        adapter = AddLora(name, path, tuple(tenants) if tenants is not None else None)
        adapter_id = await self.engine_loop.call_async(adapter)
        await self.engine_loop.call_async(AnnounceState())  # an idle worker steps not: tell now
        return adapter_id

    async def remove_lora(self, name: str) -> bool:
        """Unregister a LoRA adapter added at run time; False if this worker has none of
        that name. Its requests end with an error naming it. Raises LoraError for an adapter
        of the cluster config. The routers hear of it at once."""
        removed = await self.engine_loop.call_async(RemoveLora(name))
        if removed:
            await self.engine_loop.call_async(AnnounceState())
        return removed

    async def kv_blocks_in_use(self) -> int:
        """Blocks with a reference (0 when idle: nothing leaked)."""
        return (await self.engine_loop.call_async(Snapshot())).kv_used_blocks

    # -- peers -----------------------------------------------------------------------------

    async def export_kv(
        self, keys: Sequence[BlockKey], ctx: HashContext, start: int = 0
    ) -> RunHandle | None:
        """See :meth:`PeerPulls.export_kv` (called by a pulling peer)."""
        return await self.pulls.export_kv(keys, ctx, start)

    async def probe_export(self, n_tokens: int, max_bytes: int = 64 << 20) -> RunHandle | None:
        """See :meth:`PeerPulls.probe_export`."""
        return await self.pulls.probe_export(n_tokens, max_bytes)

    async def probe_pull(
        self, source_id: str, sizes: Sequence[int], repeats: int = 3
    ) -> dict[str, Any]:
        """See :meth:`PeerPulls.probe_pull` (the router's transfer calibration)."""
        return await self.pulls.probe_pull(source_id, sizes, repeats)

    def hot_prefixes(self, n: int) -> list[HotPrefix]:
        """See :meth:`WarmStarts.hot_prefixes` (a peer's warm start)."""
        return self.warm.hot_prefixes(n)

    async def auto_warm_start(
        self, peer_ids: Sequence[str], n: int, share: float
    ) -> dict[str, int]:
        """See :meth:`WarmStarts.auto_warm_start` (once per incarnation; never raises)."""
        return await self.warm.auto_warm_start(peer_ids, n, share)

    async def warm_start(
        self, peer_ids: Sequence[str], n: int = 16, max_blocks: int | None = None
    ) -> dict[str, int]:
        """See :meth:`WarmStarts.warm_start`."""
        return await self.warm.warm_start(peer_ids, n, max_blocks)

    def pull_stats(self) -> dict[str, Any]:
        """Pulls by outcome, tokens imported, runs exported, warm starts (status, tests)."""
        return {**self.pulls.stats(), **self.warm.stats()}

    # -- index -------------------------------------------------------------------------------

    def resync_index(self, reason: str) -> bool:
        """See :meth:`IndexLink.resync` (a router found this worker's entries wrong)."""
        return self.index.resync(reason)

    def shutdown(self) -> None:
        self.telemetry.stop_heartbeat()
        self.engine_loop.stop()
        self.index.stop()


WorkerActor = ray.remote(WorkerServer)
