"""A local ``redis-server`` on a free loopback port: the embedded default and the tests' Redis.

The launcher starts one when no Redis URL is configured; tests start one per session.
Persistence is off (the index is rebuilt from the workers' own block pools on resync).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class RedisNotInstalled(RuntimeError):
    """``redis-server`` is not on PATH."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalRedis:
    """Owns one ``redis-server`` process; ``stop()``/``start()`` keep the same port."""

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1",
                 workdir: str | Path | None = None, extra_args: list[str] | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisNotInstalled(
                "redis-server not found on PATH: install it (apt-get install redis-server) "
                "or set redis.url to an existing server"
            )
        self.binary = binary
        self.host = host
        self.port = port or free_port(host)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvc-redis-"))
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [self.binary, "--port", str(self.port), "--bind", self.host,
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--protected-mode", "yes", *self.extra_args]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.2)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.workdir / "redis.log").read_text(errors="replace")[-800:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{tail}")
            try:
                if client.ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"redis-server on {self.host}:{self.port} did not answer in {timeout_s}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def start_detached(port: int | None = None, host: str = "127.0.0.1") -> tuple[str, int]:
    """Start a server that outlives this process (``kvcluster up``); returns (url, pid)."""
    r = LocalRedis(port, host=host)
    r.start()
    pid = r.proc.pid if r.proc else -1
    r.proc = None  # forget it: ``kvcluster down`` stops it by pid
    return r.url, pid


def stop_pid(pid: int) -> None:
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        pass
