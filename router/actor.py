"""The router as a Ray actor: a grpc.aio server in the actor's event loop.

``RouterServer`` is a plain class (constructed in tests without Ray's actor machinery
except for worker handles); ``RouterActor`` wraps it in one line. Each router is stateless
apart from its cache of the index and its recent placements, so any number may run. Its
start (the gRPC and HTTP servers, background tasks) and stop: :mod:`router.lifecycle`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import ray

from kvstore.blocks.loop_sched import ThreadSchedConfig
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from router.edge.servicer import KVClusterServicer
from router.http_api import defaults as http_defaults
from router.lifecycle import RouterLifecycle, start_again_if_restarted
from router.placement.breaker import CircuitBreaker
from router.placement.config import LivenessConfig, RequestLimits, RoutingConfig
from router.placement.metrics import RouterMetrics
from router.placement.prediction import PredictionTracker
from router.placement.prefix_source import KVIndexSource
from router.placement.router import Router
from router.serving.auth import TokenAuth
from router.serving.core import ModelLimits, ServingCore
from router.serving.intake import Intake
from router.serving.ray_workers import RayWorkerDirectory
from router.serving.slo import SloBounds
from router.serving.warm_start import WarmStarter
from worker.model.config import ModelConfig
from worker.model.default_model import resolve_default_model
from worker.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Everything one router needs (built by the launcher from the cluster config)."""

    router_id: str  # actor name, e.g. "router-0"
    namespace: str  # Ray namespace of the cluster's actors
    model_dir: str | None  # the served model's folder (tokenizer, config.json); None: the
    # default model, resolved on this router's node
    model_id: str  # folded into block keys; must equal the workers'
    max_model_len: int | None  # the workers' max_model_len (None: the model's own limit)
    block_size: int  # the workers' KV block size (the router hashes prompts into the same)
    routing: RoutingConfig  # policy and weights
    index: IndexConfig | None  # None: no Redis, route by load
    host: str  # gRPC bind address
    port: int  # gRPC port (0: any free port)
    max_message_bytes: int  # gRPC message limit
    auth_tokens: dict[str, str]  # tenant -> bearer token ({} = no auth)
    limits: RequestLimits  # per-request limits enforced at the edge
    tls_cert: str | None  # PEM files; both set = TLS
    tls_key: str | None
    default_family: str = "llama"  # family of the default model (model_dir None)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # frozen-worker timeouts
    stream_interval: int = 1  # steps' tokens per client message at least
    http_port: int | None = None  # OpenAI HTTP API port (0: any free port; None: no HTTP)
    cors_allowed_origins: tuple[str, ...] = ()  # HTTP API's CORS origins (none: CORS off)
    http_max_connections: int = http_defaults.MAX_CONNECTIONS  # open HTTP connections
    http_cheap_rate_per_s: float = http_defaults.CHEAP_RATE_PER_S  # /health & co. per second
    http_cheap_max_waiting: int = http_defaults.CHEAP_MAX_WAITING  # cheap requests waiting
    sched: ThreadSchedConfig = field(default_factory=ThreadSchedConfig)  # the loop's slice
    slo: SloBounds = field(default_factory=SloBounds)  # latency objectives /metrics counts


class RouterServer(RouterLifecycle):
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
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
            timeout = settings.routing.index_timeout_s
            self.index = KVIndex(
                settings.index.model_copy(
                    update={"socket_timeout_s": timeout, "connect_timeout_s": timeout}
                )
            )
        self.metrics = RouterMetrics()
        # one breaker for every index read: a frozen Redis costs one timeout per probe
        self.breaker = CircuitBreaker(settings.routing.index_probe_interval_s)
        source = KVIndexSource(self.index, breaker=self.breaker) if self.index is not None else None
        self.router = Router(
            settings.routing, source, block_size=settings.block_size, metrics=self.metrics
        )
        self.directory = RayWorkerDirectory(
            settings.namespace,
            self.index,
            breaker=self.breaker,
            liveness=settings.liveness,
            stream_interval=settings.stream_interval,
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
        self.core = ServingCore(self.router, self.directory, limits, predictions=self.predictions)
        auth = TokenAuth(settings.auth_tokens) if settings.auth_tokens else None
        # one intake for both edges: one auth, one set of limits, one tokenizer budget
        self.intake = Intake(
            self.core, self.tokenizer, auth=auth, limits=settings.limits, slo=settings.slo
        )
        self.intake.metrics.read_core(self.core.funnel, self.predictions, self.core.phases)
        self.servicer = KVClusterServicer(
            self.intake,
            policy=settings.routing.policy,
            index_available=lambda: self.directory.index_ok,
        )
        self.http = None
        if settings.http_port is not None:
            from router.http_api import OpenAIServer  # HTTP stack only where it serves

            self.http = OpenAIServer(
                self.intake,
                max_body_bytes=settings.max_message_bytes,
                cors_origins=settings.cors_allowed_origins,
                max_connections=settings.http_max_connections,
                cheap_rate_per_s=settings.http_cheap_rate_per_s,
                cheap_max_waiting=settings.http_cheap_max_waiting,
            )
        self.server = None
        self.port: int | None = None
        self._exporter = None
        self._calibration: asyncio.Task | None = None  # the transfer model's start-up probes
        self.warm_starts: WarmStarter | None = None  # new workers' warm starts (pulls on)
        self._warm_task: asyncio.Task | None = None
        self._starting = asyncio.Lock()
        start_again_if_restarted()

    def incarnation(self) -> str:
        """Random per start of this router (workers compare it to spot a restarted caller)."""
        return self.directory.incarnation

    def stats(self) -> dict:
        """Router metrics plus retry counters (for status and tests)."""
        snap = self.metrics.snapshot()
        snap.update(
            retries=self.core.retries,
            broken_streams=self.core.broken,
            index_available=self.directory.index_ok,
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
        scheme = "https" if self.settings.tls_cert and self.settings.tls_key else "http"
        return f"{scheme}://{self.settings.host}:{self.http.port}"

    def ready(self) -> bool:
        return self.server is not None


RouterActor = ray.remote(RouterServer)
