"""Connection by URL (password, db, TLS), typed config errors, and outages."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from kvstore.config import IndexConfig, make_client
from kvstore.index import KVIndex
from kvstore.index_types import IndexUnavailable
from tests.kvstore.helpers import chain, stored
from tests.redis_server import RedisServer, make_tls_files


def test_url_with_password_and_db_is_parsed() -> None:
    client = make_client(IndexConfig(url="redis://:s3cr%40t@10.1.2.3:6380/5", model_id="m"))
    kw = client.connection_pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["password"]) == ("10.1.2.3", 6380, 5, "s3cr@t")
    assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (0.5, 0.5)
    assert kw["retry"].get_retries() == 1
    assert client.connection_pool.connection_class is redis.Connection


def test_rediss_url_builds_tls_options() -> None:
    url = (
        "rediss://user:pw@redis.example.com:6390/2?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required"
    )
    client = make_client(IndexConfig(url=url, model_id="m", socket_timeout_s=0.25))
    pool = client.connection_pool
    kw = pool.connection_kwargs
    assert pool.connection_class is redis.SSLConnection
    assert (kw["username"], kw["password"], kw["db"]) == ("user", "pw", 2)
    assert (kw["ssl_ca_certs"], kw["ssl_cert_reqs"]) == ("/etc/ca.pem", "required")
    assert kw["socket_timeout"] == 0.25


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("url", "http://localhost", "must start with"),
        ("model_id", "a{b}", "hash tag"),
        ("record_every", 0, "greater than or equal to 1"),
        ("heartbeat_ttl_s", 0, "greater than 0"),
        ("colour", "red", "Extra inputs"),
    ],
)
def test_config_rejects_bad_values(field: str, value: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        IndexConfig(**{"model_id": "m", field: value})


def test_namespace_carries_cluster_hash_tag() -> None:
    assert IndexConfig(cluster="prod", model_id="llama-3-8b").namespace == "kvc:{prod:llama-3-8b}:"


@pytest.mark.redis
def test_password_protected_server() -> None:
    with RedisServer(password="hunter2") as server:
        index = KVIndex(IndexConfig(url=server.url, model_id="m"))
        e = index.register("a")
        index.apply_events("a", e, 1, [stored(chain(3))])
        assert index.lookup(chain(3)) == {"a": 3}
        index.close()
        wrong = KVIndex(IndexConfig(url=server.url.replace("hunter2", "nope"), model_id="m"))
        with pytest.raises(IndexUnavailable, match="(?i)password|auth"):
            wrong.lookup(chain(3))
        wrong.close()


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_real_tls_server(tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path)
    with RedisServer(tls=tls) as server:
        assert server.url.startswith("rediss://")
        index = KVIndex(IndexConfig(url=server.url, model_id="m"))
        e = index.register("a")
        index.apply_events("a", e, 1, [stored(chain(4))])
        assert index.lookup(chain(4)) == {"a": 4}
        index.close()
        # a client that does not trust the CA is refused
        untrusting = KVIndex(IndexConfig(url=server.url.split("?")[0], model_id="m"))
        with pytest.raises(IndexUnavailable, match="(?i)certificate"):
            untrusting.lookup(chain(1))
        untrusting.close()


def _elapsed(call) -> float:  # noqa: ANN001
    t0 = time.monotonic()
    with pytest.raises(IndexUnavailable):
        call()
    return time.monotonic() - t0


@pytest.mark.redis
def test_stopped_server_raises_index_unavailable_promptly(redis_server: RedisServer) -> None:
    index = KVIndex(IndexConfig(url=redis_server.url, model_id="m"))
    index.register("a")
    redis_server.stop()
    assert _elapsed(lambda: index.lookup(chain(2))) < 1.0  # refused: no waiting at all
    assert _elapsed(index.live_workers) < 1.0
    redis_server.start()  # same port: the same client works again
    assert index.lookup(chain(2)) == {}  # the restarted server is empty
    index.close()


class SilentServer:
    """Accepts connections and reads what clients send, never answers; counts both."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.peers: list[tuple[str, int]] = []  # accepted, in order
        self.received = 0  # bytes, over all connections
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            self.peers.append(peer)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                self.received += len(data)

    def connections_so_far(self) -> int:
        """Connections made before this call: a marker connection is accepted after every
        earlier one (the backlog is first in, first out), however late the accept thread."""
        with socket.create_connection(("127.0.0.1", self.port)) as marker:
            mine = marker.getsockname()
            deadline = time.monotonic() + 30
            while mine not in self.peers and time.monotonic() < deadline:
                time.sleep(0.01)
            assert mine in self.peers
            return self.peers.index(mine)

    def close(self) -> None:
        for sock in (self.sock, *self._conns):  # shutdown wakes the threads blocked on them
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_unresponsive_server_raises_within_the_timeout() -> None:
    """A timeout is not retried (one connection, one command sent) and is the index's own
    socket timeout, not the slow client's (5 s at least, for resyncs and purges)."""
    sink = SilentServer()
    cfg = IndexConfig(url=f"redis://127.0.0.1:{sink.port}/0", model_id="m", socket_timeout_s=0.2)
    index = KVIndex(cfg)
    try:
        elapsed = _elapsed(lambda: index.lookup(chain(2)))
        assert 0.19 < elapsed < 5.0  # it waited its timeout; the slow client's is >= 5 s
        assert sink.connections_so_far() == 1  # not retried on a new connection
        deadline = time.monotonic() + 30
        while not sink.received and time.monotonic() < deadline:  # its reader may lag
            time.sleep(0.01)
        assert sink.received > 0  # the command was sent: it timed out waiting for the answer
    finally:
        index.close()
        sink.close()
