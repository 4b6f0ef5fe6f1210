"""The Ray this launcher starts itself: a head of our own on loopback, in Ray's single-node
mode (see :mod:`cluster.ray_session` for why), and the driver settings that must agree with it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from cluster import state
from cluster.local_redis import free_port
from cluster.state import stop_group

# Ray's switch for single-node clusters ("0": the node address is loopback, nothing binds
# beyond it); named after the platforms where it is the default
RAY_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def use_loopback_ray() -> None:
    """Put this process, and every Ray process it starts, in Ray's single-node mode: the node
    address is 127.0.0.1 and every Ray server (GCS, raylet, workers, agents, dashboard, client
    server) binds it. Call before starting an embedded Ray or joining one (else the driver
    looks for a raylet at the machine's address); never before joining another Ray (which
    registered its nodes at their own addresses)."""
    from ray._private import ray_constants

    if not _saved_mode:
        _saved_mode.append((os.environ.get(RAY_SINGLE_NODE_ENV), ray_constants.ENABLE_RAY_CLUSTER))
    os.environ[RAY_SINGLE_NODE_ENV] = "0"  # Ray processes started from here inherit it
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import in this process


def leave_loopback_ray() -> None:
    """Undo :func:`use_loopback_ray` once our Ray is shut down (a process that later joins
    another Ray, e.g. a test session, must not stay in single-node mode)."""
    from ray._private import ray_constants

    if not _saved_mode:
        return
    env, enabled = _saved_mode.pop()
    if env is None:
        os.environ.pop(RAY_SINGLE_NODE_ENV, None)
    else:
        os.environ[RAY_SINGLE_NODE_ENV] = env
    ray_constants.ENABLE_RAY_CLUSTER = enabled


_saved_mode: list[tuple[str | None, bool]] = []  # the mode before use_loopback_ray


def start_ray_head(
    num_cpus: int | None = None, timeout_s: float = 60.0, *, dashboard: bool = True
) -> tuple[str, int, str | None]:
    """A Ray head of our own on loopback (``ray start --head --block`` in its own session, so
    ``down`` stops exactly it, never another Ray on the machine), every port on 127.0.0.1.

    Returns (GCS address, pid of the head's process group, dashboard URL or None).
    """
    port, dash = free_port(), free_port()
    # without the dashboard: Ray's CLI that starts no dashboard process (cluster.ray_head)
    ray_cli = (
        [str(Path(sys.executable).with_name("ray"))]
        if dashboard
        else [sys.executable, "-m", "cluster.ray_head"]
    )
    cmd = [
        *ray_cli,
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--include-dashboard={str(dashboard).lower()}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    state.STATE_DIR.mkdir(parents=True, exist_ok=True)
    log_path = state.STATE_DIR / f"ray-head-{port}.log"
    env = {**os.environ, RAY_SINGLE_NODE_ENV: "0"}
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                url = f"http://127.0.0.1:{dash}" if dashboard else None
                return f"127.0.0.1:{port}", proc.pid, url
        except OSError:
            time.sleep(0.2)
    stop_group(proc.pid, state.RAY_HEAD_GRACE_S)
    raise RuntimeError(f"Ray head did not listen on {port} within {timeout_s}s")


def use_token_auth_if_configured() -> None:
    """Ray 2.60: ``ray start`` turns token auth on when ``~/.ray/auth_token`` exists, but a
    driver joining with ``ray.init(address=...)`` does not; apply the CLI's own rule here so
    both agree (Ray caches the mode at import, so its helper also refreshes that)."""
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
