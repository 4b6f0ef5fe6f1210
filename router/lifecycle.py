"""The router actor's lifecycle: its start (the gRPC server bound, retried while a restart
finds the port still held; the transfer model's probes and new workers' warm starts; the
metrics exporter; the HTTP API; the loop's pause and scheduling policies), its stop, and a
router Ray restarted starting itself again."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from kvstore.blocks.loop_sched import apply_loop_policy
from kvstore.blocks.pauses import WarmUpFreeze, freeze_long_lived, short_gil_turns
from kvstore.index import KVIndex
from router.edge.servicer import KVClusterServicer, start_server
from router.placement.metrics import RouterMetrics
from router.placement.prediction import PredictionTracker
from router.placement.router import Router
from router.serving.core import ServingCore
from router.serving.intake import Intake
from router.serving.pull_calibration import calibrate_transfers
from router.serving.ray_workers import RayWorkerDirectory
from router.serving.telemetry import start_exporter
from router.serving.warm_start import WarmStarter

if TYPE_CHECKING:
    from router.actor import RouterSettings

log = logging.getLogger("router.actor")  # the actor's log, as its other lines


class RouterLifecycle:
    """Mixin of :class:`~router.actor.RouterServer` (its constructor sets these up)."""

    settings: RouterSettings
    index: KVIndex | None
    metrics: RouterMetrics
    router: Router
    directory: RayWorkerDirectory
    predictions: PredictionTracker
    core: ServingCore
    intake: Intake
    servicer: KVClusterServicer
    http: Any  # the OpenAI HTTP server (None: not serving HTTP)
    server: Any  # the gRPC server once started
    port: int | None
    _exporter: Any
    _calibration: asyncio.Task | None  # the transfer model's start-up probes
    warm_starts: WarmStarter | None  # new workers' warm starts (pulls on)
    _warm_task: asyncio.Task | None
    _starting: asyncio.Lock

    async def start(self) -> str:
        """Start serving (once; later calls return the address); returns ``host:port``."""
        async with self._starting:
            if self.server is None:
                await self._start()
        return f"{self.settings.host}:{self.port}"

    async def _start(self) -> None:
        tls = None
        if self.settings.tls_cert and self.settings.tls_key:
            tls = (
                Path(self.settings.tls_cert).read_bytes(),
                Path(self.settings.tls_key).read_bytes(),
            )
        for attempt in range(50):  # a restart may find the port still held for a moment
            try:
                self.server, self.port = await start_server(
                    self.servicer,
                    host=self.settings.host,
                    port=self.settings.port,
                    max_message_bytes=self.settings.max_message_bytes,
                    tls=tls,
                )
                break
            except RuntimeError as exc:  # grpc: "Failed to bind to address"
                if attempt == 49 or not self.settings.port:
                    raise
                log.warning(
                    "router %s: port %d busy (%s), retrying",
                    self.settings.router_id,
                    self.settings.port,
                    exc,
                )
                await asyncio.sleep(0.2)
        if self.router.planner is not None:
            self._calibration = asyncio.get_running_loop().create_task(
                calibrate_transfers(self.router, self.settings.namespace, self.directory.candidates)
            )
            pull = self.settings.routing.pull
            if pull.warm_start_prefixes > 0 and self.index is not None:
                self.warm_starts = WarmStarter(
                    self.settings.namespace,
                    self.directory.live_epochs,
                    prefixes=pull.warm_start_prefixes,
                    share=pull.warm_start_share,
                )
                self._warm_task = asyncio.get_running_loop().create_task(self.warm_starts.run())
        self._exporter = start_exporter(
            self.settings.router_id,
            self.metrics,
            lambda: {"retries": self.core.retries, "broken_streams": self.core.broken},
            self.predictions,
        )
        if self.http is not None:
            await self.http.start(
                self.settings.host,
                self.settings.http_port or 0,
                tls_cert=self.settings.tls_cert,
                tls_key=self.settings.tls_key,
            )
        # every stream's output passes this loop: short GIL turns next to Ray's and gRPC's
        # threads, and no collection scans the start-up heap (~250k objects, 100-300 ms)
        _load_worker_class()
        short_gil_turns()
        freeze_long_lived()
        # and a core soon after each wake-up (this is the loop's thread)
        apply_loop_policy(self.settings.sched)
        # and once more when idle after the first requests: what they loaded (the edges'
        # code paths, Ray's state for each worker) is long-lived too
        self.core.warm_freeze = WarmUpFreeze()
        log.info(
            "router %s serving gRPC on %s:%d",
            self.settings.router_id,
            self.settings.host,
            self.port,
        )

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in (self._calibration, self._warm_task):
            if task is not None:
                task.cancel()
        if self._exporter is not None:
            self._exporter.cancel()
        if self.http is not None:
            await self.http.stop()
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
        self.core.close()
        self.directory.channels.close()
        self.intake.close()


def _load_worker_class() -> None:
    """The first ``ray.get_actor`` of a worker unpickles its actor class, importing its
    module (the engine, torch: ~150k objects, a second or more): here, at start-up, not on
    the event loop during the first request, and inside the heap frozen after it."""
    import worker.actor  # noqa: F401


def start_again_if_restarted() -> None:
    """A router that Ray restarted after a crash was constructed again but nobody calls its
    ``start``: it asks itself to, binding its old port, so the clients' channels reconnect to
    it. From a thread, until it serves: a call submitted while the actor is still being
    restored can be lost, and ``start`` is idempotent."""
    try:
        ctx = ray.get_runtime_context()
        if not ctx.was_current_actor_reconstructed:
            return
        handle = ctx.current_actor
    except RuntimeError:  # not an actor (a test constructs the class directly)
        return

    def until_serving() -> None:
        while True:
            try:
                if ray.get(handle.ready.remote(), timeout=10):
                    log.warning("router restarted by Ray: serving again on its port")
                    return
                ray.get(handle.start.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - keep trying: a router must come back
                log.warning("restarted router not serving yet: %s", exc)
                time.sleep(1.0)

    threading.Thread(target=until_serving, name="restart", daemon=True).start()
