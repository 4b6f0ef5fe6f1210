"""The components' settings, derived from the one cluster config: each fact (model id, block
size, max_model_len, the index's address) is stated once in :class:`ClusterConfig` and derived
into every worker's and router's settings here (the router config and the engine config travel
whole). Pure: starts nothing, connects to nothing."""

from __future__ import annotations

from pathlib import Path

from cluster.config import ClusterConfig
from cluster.local_redis import free_port
from kvstore.config import IndexConfig
from router.server import RouterSettings
from worker.actor import WorkerSettings
from worker.model.config import ModelConfig
from worker.model.default_model import default_model_id


def resolve_model(cfg: ClusterConfig) -> tuple[str | None, str]:
    """(model folder or None, model id). None stands for the default model: every worker and
    router resolves it on its own node (the head's path would mean nothing elsewhere); its id
    is known without resolving it."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser().resolve()
        return str(path), cfg.model.model_id or (path.stem if path.is_file() else path.name)
    return None, cfg.model.model_id or default_model_id(cfg.model.tiny_family)


def index_config(cfg: ClusterConfig, redis_url: str | None, model_id: str) -> IndexConfig | None:
    """The block index's config (None: no Redis, the routers balance load only)."""
    if redis_url is None:
        return None
    return IndexConfig(
        **{**cfg.redis.model_dump(), "url": redis_url}, cluster=cfg.name, model_id=model_id
    )


def engine_max_model_len(cfg: ClusterConfig, model_path: str | None) -> int | None:
    """The engines' max_model_len; None: the model's own (each router reads it)."""
    engine = cfg.workers.engine
    if engine.max_model_len or model_path is None:
        return engine.max_model_len
    return ModelConfig.from_dir(model_path).max_position_embeddings


def worker_settings(
    cfg: ClusterConfig,
    name: str,
    model_path: str | None,
    model_id: str,
    *,
    index: IndexConfig | None,
    namespace: str | None = None,
) -> WorkerSettings:
    return WorkerSettings(
        worker_id=name,
        model_dir=model_path,
        model_id=model_id,
        engine=cfg.workers.engine,
        index=index,
        default_family=cfg.model.tiny_family,
        sched=cfg.scheduling,
        namespace=namespace,
    )


def router_settings(
    cfg: ClusterConfig,
    i: int,
    model_path: str | None,
    model_id: str,
    *,
    namespace: str,
    index: IndexConfig | None,
    max_model_len: int | None,
) -> RouterSettings:
    """Router ``i``'s settings: the router config as stated, plus what is derived for router
    ``i``. Its ports are the configured ones plus ``i`` (a free port when
    none is configured: fixed at start, so a router Ray restarts binds it again)."""
    r = cfg.router
    return RouterSettings(
        config=r,
        router_id=f"router-{i}",
        namespace=namespace,
        model_dir=model_path,
        model_id=model_id,
        max_model_len=max_model_len,
        block_size=cfg.workers.engine.block_size,
        index=index,
        port=r.port + i if r.port else free_port(),
        http_port=None if r.http_port is None else r.http_port + i if r.http_port else free_port(),
        default_family=cfg.model.tiny_family,
        sched=cfg.scheduling,
        reasoning=cfg.workers.engine.reasoning == "auto",
    )


def actor_env(niceness: int) -> dict:
    """An actor's ``runtime_env``: the niceness its process starts at (Ray's raylet reads
    ``RAY_worker_niceness`` from the actor's environment when it starts the process, as its
    job supervisor does for drivers; without it the process runs at Ray's 15)."""
    return {"env_vars": {"RAY_worker_niceness": str(niceness)}}
