"""A router's configuration (``router:`` of the cluster config): its edges, limits, routing
policy and liveness timeouts. The launcher ships it whole to every router
(:class:`~router.server.RouterSettings`); the fields only the launcher reads are
:data:`LAUNCHER_FIELDS`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvstore.blocks.hashing import SALT_SCOPE_SEP
from kvstore.runtime.strict import Strict
from router.http_api import defaults as http_defaults
from router.placement.config import STREAM_INTERVAL, LivenessConfig, RequestLimits, RoutingConfig
from router.serving.slo import SloBounds

LAUNCHER_FIELDS = frozenset({"num_routers", "location", "niceness", "max_restarts"})
"""Fields the launcher reads to start the router actors; every other one configures a router
(``port`` and ``http_port`` through their per-router values in ``RouterSettings``)."""


class RouterConfig(Strict):
    num_routers: int = Field(
        1,
        ge=1,
        le=64,
        description="Router actors (gRPC + HTTP servers): per node with location "
        "every_node or head, in all with anywhere.",
    )
    location: Literal["every_node", "head", "anywhere"] = Field(
        "every_node",
        description="Where routers run: every_node (num_routers on each live node, started "
        "on nodes that join later and gone with their node; a load balancer or a client "
        "with every address loses nothing when a node dies), head (on the head node only), "
        "anywhere (where Ray places them). Routers on one node, or on nodes sharing an IP "
        "address, take port + k and http_port + k (k = 0, 1, ...); on hosts of their own "
        "every node serves the same ports.",
    )
    host: str = Field("127.0.0.1", description="gRPC bind address.")
    port: int = Field(
        50051,
        ge=0,
        le=65535,
        description="Routers' gRPC port (0: a free port per router); the k-th router on "
        "an IP address listens on port + k.",
    )
    max_message_bytes: int = Field(
        4 << 20,
        ge=1024,
        description="gRPC message size limit (also the OpenAI HTTP API's request body limit).",
    )
    http_port: int | None = Field(
        8000,
        ge=0,
        le=65535,
        description="Routers' OpenAI-compatible HTTP port (0: a free port per router; None: "
        "no HTTP API); the k-th router on an IP address listens on http_port + k. Same host, "
        "bearer tokens and TLS files as gRPC.",
    )
    cors_allowed_origins: list[str] = Field(
        default_factory=list,
        description="Origins browsers may call the HTTP API from (CORS), e.g. "
        "['https://app.example.com'] or ['*']; empty: CORS off (no CORS headers).",
    )
    http_max_connections: int = Field(
        http_defaults.MAX_CONNECTIONS,
        ge=1,
        le=1_000_000,
        description="Open HTTP connections a router serves at once (each streaming client "
        "holds one). A connection accepted past it gets, for its first request, an OpenAI "
        "503 server_busy with Retry-After: 1 and is closed. Keep it under the router "
        "process's file-descriptor limit (ulimit -n), which its gRPC server shares.",
    )
    http_cheap_rate_per_s: float = Field(
        http_defaults.CHEAP_RATE_PER_S,
        gt=0,
        le=1_000_000,
        description="Cheap HTTP requests a router serves per second (GET /health, /version, "
        "/metrics, /v1/models, and any wrong path or method: all but generation, /tokenize "
        "and /detokenize), a burst of as many at once; the excess waits its turn, so a "
        "poller in a loop cannot take the event loop that streams tokens.",
    )
    http_cheap_max_waiting: int = Field(
        http_defaults.CHEAP_MAX_WAITING,
        ge=0,
        le=1_000_000,
        description="Cheap requests (see http_cheap_rate_per_s) waiting their turn at once; "
        "past it they are answered 503 server_busy with Retry-After: 1.",
    )
    auth_tokens: dict[str, str] = Field(
        default_factory=dict, description="tenant -> bearer token; empty disables auth."
    )
    tls_cert: str | None = Field(None, description="PEM server certificate file (enables TLS).")
    tls_key: str | None = Field(None, description="PEM private key file for tls_cert.")
    limits: RequestLimits = Field(
        RequestLimits(),
        description="Per-request limits enforced by the routers (lengths, "
        "stop strings, n/beam width, logprobs), all in one place.",
    )
    routing: RoutingConfig = Field(
        RoutingConfig(),
        description="Placement policy and weights; the routers hash prompts with "
        "workers.engine.block_size.",
    )
    liveness: LivenessConfig = Field(
        LivenessConfig(), description="Stall and probe timeouts that catch a frozen worker."
    )
    slo: SloBounds = Field(
        SloBounds(),
        description="Latency objectives: each router exports the share of requests within "
        "the time-to-first-token bound and of tokens within the inter-token bound "
        "(kvc_slo_met / kvc_slo_observed).",
    )
    runtime_lora: bool = Field(
        False,
        description="Serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): a client loads a LoRA adapter folder "
        "(lora_path, read on every worker's node) on every worker, kept in the cluster's Redis "
        "so workers that start later load it too. With auth, the adapter is its tenant's "
        "alone. Off: both routes answer 404. Turn on only for clients you trust with paths "
        "on the workers' disks.",
    )
    responses_ttl_s: float = Field(
        3600.0,
        ge=0,
        le=30 * 86400,
        description="How long a response of the HTTP API's /v1/responses is kept in the "
        "cluster's Redis (for previous_response_id and GET /v1/responses/{id}, from any "
        "router), unless the request sets store false. 0, or no Redis: none is kept (store "
        "is answered false and previous_response_id refused).",
    )
    responses_max_tenant_bytes: int = Field(
        256 << 20,
        ge=0,
        le=1 << 40,
        description="The most a tenant (all unauthenticated clients together are one) keeps "
        "in the response store at once, in bytes of JSON; past it its new responses are "
        "answered with store false until kept ones expire or are deleted. It bounds what "
        "clients can put in the Redis the global index needs.",
    )
    log_stats: bool = Field(
        True,
        description="Measure each streamed output for /metrics: time to first token, "
        "inter-token and request latency, token and finish counters, SLO attainment "
        "(vLLM's --disable-log-stats turns its equivalent off). Off: those series stay at "
        "zero; the gauges and what the workers measure are still exported.",
    )
    stream_interval: int = Field(
        STREAM_INTERVAL,
        ge=1,
        le=64,
        description="Engine steps whose tokens one client message (a gRPC message, an SSE "
        "event) carries at least, on both edges: 1 sends each step's tokens as they come; "
        "more sends fewer, larger messages (less router and client CPU per token, more "
        "inter-token latency). The first token and the last are never held back, and a "
        "client that lags gets several steps' tokens per message whatever this is.",
    )
    niceness: int = Field(
        0,
        ge=0,
        le=19,
        description="Router processes' niceness (Ray starts actors at 15 unless told). "
        "Keep it equal to workers.niceness on nodes that run both: a router niced below a "
        "busy worker waits for a core while the worker's outputs queue behind it.",
    )
    migration_limit: int = Field(
        3,
        ge=0,
        le=16,
        description="Times one request may move to another worker after its worker died "
        "mid-stream (continued from the tokens already sent; 0: never, the stream ends "
        "UNAVAILABLE). See docs/failures.md for what a moved request guarantees.",
    )
    max_restarts: int = Field(
        -1,
        ge=-1,
        description="Ray restarts of a router that died (-1: always). A restarted "
        "router binds the same port again; clients' gRPC channels reconnect to it.",
    )

    @model_validator(mode="after")
    def _tokens_name_one_tenant_each(self) -> RouterConfig:
        # An empty token would admit every caller without one as that tenant, a shared
        # token would serve one tenant as another, and "#" separates a tenant's salts.
        seen: dict[str, str] = {}
        for tenant, token in self.auth_tokens.items():
            if not tenant or SALT_SCOPE_SEP in tenant:
                raise ValueError(
                    f"auth_tokens: tenant {tenant!r} must be a non-empty name without "
                    f"{SALT_SCOPE_SEP!r}"
                )
            if len(tenant) > self.limits.max_tenant_chars:
                raise ValueError(
                    f"auth_tokens: tenant {tenant[:16]!r}... is {len(tenant)} characters, over "
                    f"limits.max_tenant_chars={self.limits.max_tenant_chars}"
                )
            if not token.strip() or token != token.strip():
                raise ValueError(
                    f"auth_tokens: tenant {tenant!r} has an empty token or one with "
                    "surrounding whitespace"
                )
            if token in seen:
                raise ValueError(
                    f"auth_tokens: tenants {seen[token]!r} and {tenant!r} have the same token; "
                    "each tenant needs its own"
                )
            seen[token] = tenant
        return self
