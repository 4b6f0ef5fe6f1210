"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer


@pytest.fixture(scope="session", autouse=True)
def _kvcluster_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the code caches on disk (kernels, tiny models, GGUF tokenizers) goes to a tmp
    dir, never the real home; set before any Ray cluster starts, so its processes inherit it."""
    old = os.environ.get("KVCLUSTER_CACHE")
    os.environ["KVCLUSTER_CACHE"] = str(tmp_path_factory.mktemp("kvcluster-cache"))
    yield
    if old is None:
        os.environ.pop("KVCLUSTER_CACHE", None)
    else:
        os.environ["KVCLUSTER_CACHE"] = old


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port (``.url``; ``.stop()``/``.start()`` on the
    same port for outage tests), removed after the test."""
    with RedisServer() as server:
        yield server
