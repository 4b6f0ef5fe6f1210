"""One hardened cluster for the abuse tests: gRPC over TLS with bearer-token auth (two
tenants), a Redis that wants a password over TLS, small queues (2 running + 2 waiting per
worker), a per-tenant quota of a quarter of each worker's cache and a 256 KiB message
limit. Certificates come from ``openssl`` in a temp dir.

Every log record of this process and every Ray log file of the session is kept for the
secrets test (no token and no Redis password may appear in any of them).
"""

from __future__ import annotations

import logging
import os
import secrets

import pytest

from cluster.client import KVClusterClient
from cluster.launcher import Cluster
from cluster.local_redis import LocalRedis
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import shared_ray
from tests.redis_server import make_tls_files

TOKENS = {"alice": secrets.token_urlsafe(24), "bob": secrets.token_urlsafe(24)}
REDIS_PASSWORD = secrets.token_urlsafe(24)
MAX_MESSAGE_BYTES = 256 << 10
# small queues; each tenant may keep a quarter of a worker's KV blocks cached while idle
GUARD_ENGINE = {**ENGINE, "max_num_seqs": 2, "max_waiting": 2, "tenant_cache_fraction": 0.25}


class Records(logging.Handler):
    """Keeps every formatted record (the secrets test greps them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="package")
def log_records() -> Records:
    handler = Records()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="package")
def tls(tmp_path_factory):  # noqa: ANN201
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="package")
def redis_server(tls) -> LocalRedis:  # noqa: ANN001
    server = LocalRedis(password=REDIS_PASSWORD, tls=tls).start()
    yield server
    server.close()


@pytest.fixture(scope="package")
def secure(log_records, tls, redis_server) -> Cluster:  # noqa: ANN001
    cfg = cluster_config(
        f"rel-guard-{os.getpid()}",
        workers={"engine": GUARD_ENGINE},
        router={
            "auth_tokens": TOKENS,
            "tls_cert": str(tls.cert),
            "tls_key": str(tls.key),
            "max_message_bytes": MAX_MESSAGE_BYTES,
        },
        redis={"url": redis_server.url},
    )
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cfg) as c:
        yield c


def connect(
    cluster: Cluster,
    tls,
    tenant: str | None = "alice",
    *,  # noqa: ANN001
    token: str | None = None,
) -> KVClusterClient:
    """A TLS client of router 0 with ``tenant``'s token (or ``token`` as given)."""
    return KVClusterClient(
        cluster.endpoints[0],
        root_cert=tls.ca.read_bytes(),
        token=token if token is not None else TOKENS.get(tenant or ""),
        max_message_bytes=4 * MAX_MESSAGE_BYTES,
    )


@pytest.fixture
def alice(secure, tls) -> KVClusterClient:  # noqa: ANN001
    with connect(secure, tls, "alice") as c:
        yield c


@pytest.fixture
def bob(secure, tls) -> KVClusterClient:  # noqa: ANN001
    with connect(secure, tls, "bob") as c:
        yield c
