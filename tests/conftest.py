"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
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


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_ray() -> Iterator[None]:
    """The session's shared Ray (tests/embedded_ray.py) stops with the session."""
    yield
    if "tests.embedded_ray" in sys.modules:  # (imported by whatever used Ray)
        sys.modules["tests.embedded_ray"].no_ray()


@pytest.fixture
def ray_shared() -> None:
    """The session's shared Ray, connected: for tests whose code starts a cluster in-process
    (benchmarks' smoke runs), so the cluster joins it instead of starting a Ray of its own."""
    from tests.embedded_ray import shared_ray

    shared_ray()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Once no cluster is left on the shared Ray (the fixtures of the test and any scope it
    ended are torn down) and the next test does not start Ray, the shared Ray stops: tests
    that need no Ray get the machine's cores to themselves."""
    yield
    if nextitem is not None and nextitem.get_closest_marker("ray") is not None:
        return
    rays = sys.modules.get("tests.embedded_ray")
    if rays is not None and rays.shared_ray_up() and not rays.named_actors():
        rays.no_ray()
