"""Typed cluster configuration: pydantic, YAML, frozen, unknown keys rejected.

Every field has a description; ``kvcluster up --config FILE.yaml`` loads one, and every
field left out takes the embedded default (local Ray, a local ``redis-server`` on a free
loopback port, the offline tiny model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    path: str | None = Field(
        None, description="Hugging Face model folder; None builds the offline tiny model."
    )
    model_id: str | None = Field(
        None, description="Id folded into block hashes and index keys; default: folder name."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights/KV dtype.")
    tiny_family: Literal["llama", "mistral", "qwen2", "qwen3"] = Field(
        "llama", description="Family of the offline model when path is None."
    )


class WorkerConfig(_Strict):
    num_workers: int = Field(2, ge=1, le=1024, description="Workers on CPU-only clusters.")
    use_gpu: bool = Field(False, description="One worker per GPU (num_gpus=1) when true.")
    num_cpus_per_worker: float = Field(0.5, gt=0, description="Ray CPUs reserved per worker.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        512, ge=2, description="KV blocks per worker; None sizes from kv_memory_bytes."
    )
    kv_memory_bytes: int | None = Field(None, ge=1, description="KV budget per worker.")
    max_num_seqs: int = Field(64, ge=1, description="Running sequences per worker.")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Token budget per step.")
    max_waiting: int = Field(256, ge=1, description="Waiting queue bound (overload error).")
    max_model_len: int | None = Field(None, ge=16, description="Default: model's maximum.")
    attn_backend: str = Field("torch", description="'torch' (CPU/CUDA) or 'triton' (CUDA).")
    max_restarts: int = Field(3, ge=-1, description="Ray actor restarts on failure (-1: inf).")


class RouterConfig(_Strict):
    num_routers: int = Field(1, ge=1, le=64, description="Router actors (gRPC servers).")
    host: str = Field("127.0.0.1", description="gRPC bind address.")
    port: int = Field(50051, ge=0, le=65535, description="First router's port (0: free port).")
    policy: Literal["round_robin", "least_loaded", "prefix_affinity"] = Field(
        "prefix_affinity", description="Placement policy."
    )
    max_message_bytes: int = Field(4 << 20, ge=1024, description="gRPC message size limit.")
    auth_tokens: dict[str, str] = Field(
        default_factory=dict, description="tenant -> bearer token; empty disables auth."
    )
    tls_cert: str | None = Field(None, description="PEM server certificate (enables TLS).")
    tls_key: str | None = Field(None, description="PEM private key for tls_cert.")


class RedisConfig(_Strict):
    url: str | None = Field(
        None, description="redis:// or rediss:// URL; None starts a local redis-server."
    )
    record_every: int = Field(1, ge=1, description="Index every k-th block key.")
    heartbeat_ttl_s: float = Field(5.0, gt=0, description="Worker liveness TTL.")

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis.url must start with redis://, rediss:// or unix://, got {v!r}")
        return v


class ClusterConfig(_Strict):
    name: str = Field("kvcluster", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Namespace.")
    ray_address: str | None = Field(None, description="Ray address; None starts a local Ray.")
    model: ModelConfig = ModelConfig()
    workers: WorkerConfig = WorkerConfig()
    router: RouterConfig = RouterConfig()
    redis: RedisConfig = RedisConfig()


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
