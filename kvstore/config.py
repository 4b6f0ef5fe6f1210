"""Typed configuration of the index and the Redis client built from it."""

from __future__ import annotations

from typing import Literal

import redis
from pydantic import Field, field_validator
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.runtime.strict import Strict


class IndexSettings(Strict):
    """How to reach the index and how it samples block keys (the cluster config's ``redis:``).

    ``url`` accepts ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` for TLS and
    ``unix://``; None: the launcher starts a local ``redis-server``. TLS and client options
    that the URL's query string names (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
    ``ssl_cert_reqs``, ``ssl_check_hostname``, ...) are passed to redis-py as they are and
    take precedence over the timeouts below.
    """

    url: str | None = Field(
        None, description="redis://, rediss:// or unix:// URL; None starts a local redis-server"
    )
    record_every: int = Field(
        1, ge=1, description="record every k-th block key; lookups are exact at that granularity"
    )
    lookup: Literal["bisect", "scan"] = Field(
        "bisect",
        description=(
            "bisect: O(breakpoints x log n) probes, exact when every publisher's cache is "
            "prefix-closed (this engine's is); scan: reads every key, exact for any publisher"
        ),
    )
    heartbeat_ttl_s: float = Field(5.0, gt=0, description="a worker without heartbeat is dead")
    socket_timeout_s: float = Field(0.5, gt=0, description="per-command read/write timeout")
    connect_timeout_s: float = Field(0.5, gt=0, description="TCP/TLS connect timeout")

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url {value!r} must start with redis://, rediss:// or unix://")
        return value


class IndexConfig(IndexSettings):
    """One (cluster, model)'s index: the settings, a server, and the key namespace."""

    url: str = Field("redis://127.0.0.1:6379/0", description="redis://, rediss:// or unix:// URL")
    cluster: str = Field("default", min_length=1, description="cluster name (key namespace)")
    model_id: str = Field(min_length=1, description="served model (key namespace)")

    @field_validator("cluster", "model_id")
    @classmethod
    def _no_braces(cls, value: str) -> str:
        if "{" in value or "}" in value:
            raise ValueError(
                f"{value!r} contains '{{' or '}}', which would break the Redis Cluster hash tag; "
                "rename it without braces"
            )
        return value

    @property
    def namespace(self) -> str:
        """Prefix of every key; the braces are the Redis Cluster hash tag (one slot per model)."""
        return f"kvc:{{{self.cluster}:{self.model_id}}}:"


def _client_kwargs(config: IndexConfig, retry: object) -> dict:
    return {
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": retry,
        "decode_responses": False,
    }


def make_client(config: IndexConfig) -> redis.Redis:
    """A thread-safe redis-py client (hiredis parser when installed) with bounded waits.

    One retry, without backoff and only on connection errors, lets a pooled connection that a
    Redis restart closed reconnect once; timeouts are not retried, so a dead or unreachable
    server surfaces within about one timeout.
    """
    retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
    return redis.Redis.from_url(config.url, **_client_kwargs(config, retry))
