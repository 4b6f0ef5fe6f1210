"""A real ``redis-server`` for tests: free loopback port, temp dir, no persistence.

``RedisServer`` can be stopped and started again on the same port (outage tests), and can
serve TLS (``tls=TlsFiles``) or require a password. No fakes: this is the real binary.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class TlsFiles:
    """A self-signed CA and a server certificate for 127.0.0.1 (see :func:`make_tls_files`)."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Generate a CA and a server cert valid for IP 127.0.0.1 with the ``openssl`` CLI."""
    d = Path(directory)
    ca, ca_key = d / "ca.pem", d / "ca.key"
    cert, key, csr = d / "server.pem", d / "server.key", d / "server.csr"
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvc-test-ca",
        "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(key), "-out", str(csr))  # fmt: skip
    ssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return TlsFiles(ca, cert, key)


class RedisServer:
    """One ``redis-server`` process; ``start()``/``stop()`` may be repeated (same port)."""

    def __init__(self, *, password: str | None = None, tls: TlsFiles | None = None) -> None:
        self.port = free_port()
        self.password = password
        self.tls = tls
        self._dir = Path(tempfile.mkdtemp(prefix="kvc-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2.0)

    def _args(self) -> list[str]:
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--dir", str(self._dir), "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            t = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(t.cert),
                     "--tls-key-file", str(t.key), "--tls-ca-cert-file", str(t.ca),
                     "--tls-auth-clients", "no"]  # fmt: skip
        else:
            args += ["--port", str(self.port)]
        return args

    def start(self, timeout_s: float = 10.0) -> None:
        assert self._proc is None, "already running"
        log = open(self._dir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self._proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        client = self.client()
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    log_text = (self._dir / "redis.log").read_text(errors="replace")
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on {self.port}:\n{log_text}")
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
