"""A local ``redis-server`` on a free loopback port: the embedded default and the tests' Redis.

The launcher starts one when no Redis URL is configured; tests start one per test. No
persistence (the index is rebuilt from the workers' own block pools on resync). ``stop()``
then ``start()`` reuses the same port (outage tests); optional password and TLS.
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


class RedisNotInstalled(RuntimeError):
    """``redis-server`` is not on PATH."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS server: the CA clients trust, the server certificate and key."""

    ca: Path
    cert: Path
    key: Path


class LocalRedis:
    """Owns one ``redis-server`` process; ``stop()``/``start()`` keep the same port."""

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalled(
                "redis-server not found on PATH: install it (apt-get install redis-server) "
                "or set redis.url to an existing server"
            )
        self.binary = binary
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.tls = tls
        self.workdir = Path(tempfile.mkdtemp(prefix="kvc-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2.0)

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--bind",
            self.host,
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--protected-mode",
            "yes",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            t = self.tls
            args += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(t.cert),
                "--tls-key-file",
                str(t.key),
                "--tls-ca-cert-file",
                str(t.ca),
                "--tls-auth-clients",
                "no",
            ]
        else:
            args += ["--port", str(self.port)]
        return args

    def start(self, timeout_s: float = 10.0, *, detach: bool = False) -> LocalRedis:
        """Start and wait for PING. ``detach``: own session, outlives this process."""
        if self.alive():
            return self
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                self._args(), stdout=log, stderr=subprocess.STDOUT, start_new_session=detach
            )
        deadline = time.monotonic() + timeout_s
        client = self.client()
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    text = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on {self.port}:\n{text}")
                time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
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

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_detached(port: int | None = None, host: str = "127.0.0.1") -> tuple[str, int]:
    """Start a server that outlives this process (``kvcluster up``); returns (url, pid)."""
    r = LocalRedis(port, host=host).start(detach=True)
    assert r.proc is not None
    pid = r.proc.pid
    r.proc = None  # forget it: ``kvcluster down`` stops it by pid
    return r.url, pid
