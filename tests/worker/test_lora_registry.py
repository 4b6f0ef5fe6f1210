"""The cluster's run-time LoRA adapters in a real Redis (``AdapterRegistry``), and a starting
worker registering them: the good ones served, a bad one or an unreachable Redis logged and
skipped, never a failed start."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from kvstore.adapter_registry import AdapterRegistry, RegisteredAdapter
from kvstore.config import IndexConfig, make_client
from tests.redis_server import RedisServer
from worker.actor import WorkerServer, WorkerSettings
from worker.engine import Engine, EngineConfig
from worker.model.build_tiny_lora import build_tiny_lora
from worker.registered_adapters import register_from_registry

pytestmark = pytest.mark.redis


def registry(server: RedisServer, model_id: str = "m") -> AdapterRegistry:
    index = IndexConfig(url=server.url, model_id=model_id)
    return AdapterRegistry(make_client(index), index.namespace)


@pytest.fixture(scope="module")
def good_dir(tiny_dir: Path, tmp_path_factory) -> str:
    return str(build_tiny_lora(tmp_path_factory.mktemp("loras") / "good", tiny_dir, rank=4))


def test_add_get_remove_all(redis_server: RedisServer) -> None:
    reg = registry(redis_server)
    everyone = RegisteredAdapter("b", "/adapters/b", None)
    some = RegisteredAdapter("a", "/adapters/a", ("bob", "alice"))
    assert reg.all() == [] and reg.get("a") is None
    assert reg.add(everyone) and reg.add(some)
    assert reg.get("a") == some and reg.get("b") == everyone
    assert reg.all() == [some, everyone]  # by name
    assert not reg.add(RegisteredAdapter("a", "/adapters/a2", None))  # the name is taken
    assert reg.get("a") == some
    assert registry(redis_server, "other").all() == []  # one registry per (cluster, model)
    assert reg.remove("a") is True and reg.remove("a") is False
    assert reg.all() == [everyone]


def test_registered_at_start_bad_ones_skipped(
    redis_server: RedisServer, tiny_dir: Path, good_dir: str, tmp_path: Path, caplog
) -> None:
    reg = registry(redis_server)
    assert reg.add(RegisteredAdapter("good", good_dir, ("bob",)))
    assert reg.add(RegisteredAdapter("bad", str(tmp_path / "not-on-this-node"), None))
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    with caplog.at_level(logging.WARNING, logger="worker.registered_adapters"):
        assert register_from_registry(engine, reg) == ["good"]
    assert set(engine.loras) == {"good"} and engine.lora_tenants == {"good": ("bob",)}
    assert "'bad'" in caplog.text and "not-on-this-node" in caplog.text


def test_an_unreachable_registry_registers_nothing(
    redis_server: RedisServer, tiny_dir: Path, caplog
) -> None:
    reg = registry(redis_server)
    redis_server.stop()
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="worker.registered_adapters"):
        assert register_from_registry(engine, reg) == []
    assert time.monotonic() - t0 < 5  # the client's timeouts bound it
    assert engine.loras == {} and "not read" in caplog.text


def test_a_worker_starts_with_the_registry_and_unloads(
    redis_server: RedisServer, tiny_dir: Path, good_dir: str, tmp_path: Path
) -> None:
    reg = registry(redis_server)
    assert reg.add(RegisteredAdapter("good", good_dir, None))
    assert reg.add(RegisteredAdapter("bad", str(tmp_path / "missing"), None))
    index = IndexConfig(url=redis_server.url, model_id="m", heartbeat_ttl_s=2.0)
    cfg = EngineConfig(num_blocks=32, lora_adapters={"cfg": good_dir})
    server = WorkerServer(WorkerSettings("worker-0", str(tiny_dir), "m", cfg, index))
    try:
        assert set(server.engine.loras) == {"cfg", "good"}
        assert asyncio.run(server.remove_lora("good")) is True
        assert asyncio.run(server.remove_lora("good")) is False
        with pytest.raises(ValueError, match="workers.engine.lora_adapters"):
            asyncio.run(server.remove_lora("cfg"))
        with server.engine_loop.paused() as engine:
            assert set(engine.loras) == {"cfg"}
    finally:
        server.shutdown()
