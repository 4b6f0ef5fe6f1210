"""The router as a Ray actor: a grpc.aio server (and the OpenAI HTTP API) in the actor's
event loop.

``RouterServer`` is a plain class (constructed in tests without Ray's actor machinery
except for worker handles); ``RouterActor`` wraps it in one line. Each router is stateless
apart from its cache of the index and its recent placements, so any number may run. The
server wires placement, serving and the edges together, starts them (the gRPC server bound,
retried while a restart finds the port still held; the transfer model's probes and new
workers' warm starts; the metrics exporter; the HTTP API; the loop's pause and scheduling
policies) and stops them; a router Ray restarted starts itself again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from kvstore.adapter_registry import AdapterRegistry
from kvstore.config import IndexConfig, make_client
from kvstore.index import KVIndex
from kvstore.runtime.loop_sched import ThreadSchedConfig, apply_loop_policy
from kvstore.runtime.pauses import WarmUpFreeze, freeze_long_lived, short_gil_turns
from router.edge.servicer import KVClusterServicer, start_server
from router.placement.breaker import CircuitBreaker
from router.placement.prediction import PredictionTracker
from router.placement.prefix_source import KVIndexSource
from router.placement.router import Router
from router.placement.router_metrics import RouterMetrics
from router.server_config import RouterConfig
from router.serving.auth import TokenAuth
from router.serving.core import ModelLimits, ServingCore
from router.serving.edge_intake import Intake
from router.serving.metrics_exporter import start_exporter
from router.serving.pull_calibration import calibrate_transfers
from router.serving.ray_workers import RayWorkerDirectory
from router.serving.warm_start import WarmStarter
from worker.model.config import ModelConfig
from worker.model.default_model import resolve_default_model
from worker.model.reasoning_markers import ReasoningMarkers
from worker.model.tokenizer import Tokenizer

log = logging.getLogger("router.server")
STORE_TIMEOUT_S = 2.0  # the response store's Redis calls (a kept response: off the token path)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything one router needs: the cluster's router config as stated, and what the
    launcher derives for this router (its name and ports, the model and index it serves)."""

    config: RouterConfig  # edges, limits, routing, liveness (ports: the two below)
    router_id: str  # actor name, e.g. "router-0"
    namespace: str  # Ray namespace of the cluster's actors
    model_dir: str | None  # the served model's folder (tokenizer, config.json); None: the
    # default model, resolved on this router's node
    model_id: str  # folded into block keys; must equal the workers'
    max_model_len: int | None  # the workers' max_model_len (None: the model's own limit)
    block_size: int  # the workers' KV block size (the router hashes prompts into the same)
    index: IndexConfig | None  # None: no Redis, route by load
    port: int  # this router's gRPC port (0: any free port)
    http_port: int | None  # its OpenAI HTTP API port (0: any free port; None: no HTTP)
    default_family: str | None = None  # family of the default model (model_dir None)
    sched: ThreadSchedConfig = field(default_factory=ThreadSchedConfig)  # the loop's slice
    reasoning: bool = True  # answers split into reasoning and content (engine.reasoning)


class RouterServer:
    """One router: placement (:class:`Router`), serving (:class:`ServingCore` over a
    :class:`RayWorkerDirectory`), one :class:`Intake` for both edges, the gRPC servicer and
    the OpenAI HTTP server; :meth:`start` serves, :meth:`stop` ends it."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        cfg = settings.config
        model_dir = (
            Path(settings.model_dir)
            if settings.model_dir is not None
            else resolve_default_model(settings.default_family)
        )
        self.tokenizer = Tokenizer.from_dir(model_dir)
        model_cfg = ModelConfig.from_dir(model_dir)
        max_model_len = settings.max_model_len or model_cfg.max_position_embeddings
        self.index = None
        if settings.index is not None:  # reads on the request path: short timeouts
            timeout = cfg.routing.index_timeout_s
            self.index = KVIndex(
                settings.index.model_copy(
                    update={"socket_timeout_s": timeout, "connect_timeout_s": timeout}
                )
            )
        self.metrics = RouterMetrics()
        # one breaker for every index read: a frozen Redis costs one timeout per probe
        self.breaker = CircuitBreaker(cfg.routing.index_probe_interval_s)
        source = KVIndexSource(self.index, breaker=self.breaker) if self.index is not None else None
        self.router = Router(
            cfg.routing, source, block_size=settings.block_size, metrics=self.metrics
        )
        self.directory = RayWorkerDirectory(
            settings.namespace,
            self.index,
            breaker=self.breaker,
            timeouts=cfg.liveness,
            stream_interval=cfg.stream_interval,
        )
        limits = ModelLimits(
            model_id=settings.model_id,
            vocab_size=model_cfg.vocab_size,
            max_model_len=max_model_len,
            max_prompt_tokens=max_model_len - 1,
        )
        # a miss is a gap of one block at the index's granularity
        record_every = settings.index.record_every if settings.index is not None else 1
        self.predictions = PredictionTracker(settings.block_size * record_every)
        self.core = ServingCore(
            self.router,
            self.directory,
            limits,
            migration_limit=cfg.migration_limit,
            predictions=self.predictions,
        )
        auth = TokenAuth(cfg.auth_tokens) if cfg.auth_tokens else None
        # one intake for both edges: one auth, one set of limits, one tokenizer budget
        self.intake = Intake(
            self.core,
            self.tokenizer,
            auth=auth,
            limits=cfg.limits,
            slo=cfg.slo,
            log_stats=cfg.log_stats,
            reasoning=ReasoningMarkers.of(self.tokenizer) if settings.reasoning else None,
        )
        self.intake.metrics.read_core(self.core.funnel, self.predictions, self.core.phases)
        self.servicer = KVClusterServicer(
            self.intake,
            policy=cfg.routing.policy,
            index_available=lambda: self.directory.index_ok,
            routers=lambda: self.cluster_routers,
        )
        self.http = None
        if settings.http_port is not None:
            from router.http_api import OpenAIServer  # HTTP stack only where it serves
            from router.http_api.response_store import ResponseStore

            store = adapters = None
            # their own clients: reads and writes off the request path's short timeouts
            waits = {"socket_timeout_s": STORE_TIMEOUT_S, "connect_timeout_s": STORE_TIMEOUT_S}
            if settings.index is not None and cfg.runtime_lora:
                client = make_client(settings.index.model_copy(update=waits))
                adapters = AdapterRegistry(client, settings.index.namespace)
            if settings.index is not None and cfg.responses_ttl_s > 0:
                client = make_client(settings.index.model_copy(update=waits))
                store = ResponseStore(
                    client,
                    settings.index.namespace,
                    cfg.responses_ttl_s,
                    cfg.responses_max_tenant_bytes,
                )
            self.http = OpenAIServer(
                self.intake,
                max_body_bytes=cfg.max_message_bytes,
                cors_origins=tuple(cfg.cors_allowed_origins),
                max_connections=cfg.http_max_connections,
                cheap_rate_per_s=cfg.http_cheap_rate_per_s,
                cheap_max_waiting=cfg.http_cheap_max_waiting,
                responses_store=store,
                runtime_lora=cfg.runtime_lora,
                adapters=adapters,
            )
        # every router of the cluster, (gRPC address, HTTP URL or None), as the launcher's
        # router keeper last told (set_routers); ClusterStatus lists them
        self.cluster_routers: list[tuple[str, str | None]] = []
        self.server = None  # the gRPC server once started
        self.port: int | None = None
        self._exporter = None
        self._calibration: asyncio.Task | None = None  # the transfer model's start-up probes
        self.warm_starts: WarmStarter | None = None  # new workers' warm starts (pulls on)
        self._warm_task: asyncio.Task | None = None
        self._starting = asyncio.Lock()
        self.serving_cpu_s: float | None = None  # process CPU seconds when it began serving
        start_again_if_restarted()

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> str:
        """Start serving (once; later calls return the address); returns ``host:port``."""
        async with self._starting:
            if self.server is None:
                await self._start()
        return f"{self.settings.config.host}:{self.port}"

    async def _start(self) -> None:
        s, cfg = self.settings, self.settings.config
        tls = None
        if cfg.tls_cert and cfg.tls_key:
            tls = (Path(cfg.tls_cert).read_bytes(), Path(cfg.tls_key).read_bytes())
        for attempt in range(50):  # a restart may find the port still held for a moment
            try:
                self.server, self.port = await start_server(
                    self.servicer,
                    host=cfg.host,
                    port=s.port,
                    max_message_bytes=cfg.max_message_bytes,
                    tls=tls,
                )
                break
            except RuntimeError as exc:  # grpc: "Failed to bind to address"
                if attempt == 49 or not s.port:
                    raise
                log.warning("router %s: port %d busy (%s), retrying", s.router_id, s.port, exc)
                await asyncio.sleep(0.2)
        if self.router.planner is not None:
            self._calibration = asyncio.get_running_loop().create_task(
                calibrate_transfers(self.router, s.namespace, self.directory.candidates)
            )
            pull = cfg.routing.pull
            if pull.warm_start_prefixes > 0 and self.index is not None:
                self.warm_starts = WarmStarter(
                    s.namespace,
                    self.directory.live_epochs,
                    prefixes=pull.warm_start_prefixes,
                    share=pull.warm_start_share,
                )
                self._warm_task = asyncio.get_running_loop().create_task(self.warm_starts.run())
        self._exporter = start_exporter(
            s.router_id,
            self.metrics,
            lambda: {
                "retries": self.core.retries,
                "broken_streams": self.core.broken,
                "migrations": dict(self.core.migrations),
            },
            self.predictions,
        )
        if self.http is not None:
            await self.http.start(
                cfg.host, s.http_port or 0, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key
            )
        # every stream's output passes this loop: short GIL turns next to Ray's and gRPC's
        # threads, and no collection scans the start-up heap (~250k objects, 100-300 ms)
        _load_worker_class()
        short_gil_turns()
        freeze_long_lived()
        # and a core soon after each wake-up (this is the loop's thread)
        apply_loop_policy(s.sched)
        # and once more when idle after the first requests: what they loaded (the edges'
        # code paths, Ray's state for each worker) is long-lived too
        self.core.warm_freeze = WarmUpFreeze()
        # the CPU this process took to serve (its start, imports, construction): a joining
        # node's figure beside the wall time, which a busy machine stretches
        self.serving_cpu_s = time.process_time()
        log.info("router %s serving gRPC on %s:%d", s.router_id, cfg.host, self.port)

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

    # -- queries -------------------------------------------------------------------------------

    def incarnation(self) -> str:
        """Random per start of this router (workers compare it to spot a restarted caller)."""
        return self.directory.incarnation

    def stats(self) -> dict:
        """Router metrics plus retry counters (for status and tests)."""
        snap = self.metrics.snapshot()
        snap.update(
            retries=self.core.retries,
            broken_streams=self.core.broken,
            migrations=dict(self.core.migrations),
            index_available=self.directory.index_ok,
            serving_cpu_s=self.serving_cpu_s,
            **self.breaker.snapshot(),
            **self.predictions.totals(),
            **self.predictions.pull_totals(),
        )
        if self.router.planner is not None:
            snap.update({f"pull_priced_{k}": v for k, v in self.router.planner.choices.items()})
        return snap

    async def loop_lag(self, reset: bool = False, trace: bool = False) -> dict:
        """This actor's event-loop lag: the largest stall since the last reset (the probe
        starts on the first call); ``trace``: attribute stalls from now on (a diagnostic)."""
        return self.directory.loop_probe.report(reset=reset, trace=trace)

    def warm_start_results(self) -> dict[str, dict[str, int]]:
        """Per worker, what the warm start this router asked of it did (for tests)."""
        return dict(self.warm_starts.results) if self.warm_starts is not None else {}

    def http_endpoint(self) -> str | None:
        """``http(s)://host:port`` of the OpenAI API (None: not serving HTTP)."""
        if self.http is None or self.http.port is None:
            return None
        cfg = self.settings.config
        scheme = "https" if cfg.tls_cert and cfg.tls_key else "http"
        return f"{scheme}://{cfg.host}:{self.http.port}"

    def ready(self) -> bool:
        return self.server is not None

    def set_routers(self, routers: list[tuple[str, str | None]]) -> None:
        """Every router of the cluster now, (gRPC address, HTTP URL or None) each: the
        launcher tells each router when the list changes and every few seconds (a restarted
        router learns it again)."""
        self.cluster_routers = [(g, h) for g, h in routers]


RouterActor = ray.remote(RouterServer)


def _load_worker_class() -> None:
    """The first ``ray.get_actor`` of a worker unpickles its actor class, importing its
    module: here, at start-up, not on the event loop during the first request, and inside
    the heap frozen after it (the module defers the engine's imports, torch among them, to
    the worker's constructor: a router never loads them)."""
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
