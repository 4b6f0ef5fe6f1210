"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port (``.url``; ``.stop()``/``.start()`` on the
    same port for outage tests), removed after the test."""
    with RedisServer() as server:
        yield server
