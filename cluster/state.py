"""What a detached cluster leaves behind (the state file ``~/.kvcluster/<name>.json``) and
the process groups it started (its Ray head, its redis-server), which ``down`` stops."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.config import ConfigError

STATE_DIR = Path(os.environ.get("KVCLUSTER_STATE_DIR", Path.home() / ".kvcluster"))


@dataclass
class ClusterState:
    """What ``kvcluster up`` leaves behind for ``down``/``status``/``generate``."""

    name: str  # cluster name (Ray namespace "kvcluster-<name>")
    namespace: str  # Ray namespace of the actors
    ray_address: str  # GCS address the actors live in
    ray_pid: int | None  # process group of the Ray head ``up`` started (``down`` stops it)
    redis_url: str | None  # the index's Redis (None: no index)
    redis_pid: int | None  # pid of the redis-server ``up`` started, if any
    endpoints: list[str]  # the routers' gRPC host:port
    dashboard_url: str | None  # Ray dashboard
    model_dir: str | None  # served model folder (None: the default, resolved on each node)
    workers: list[str]  # worker actor names
    http_endpoints: list[str] = field(default_factory=list)  # the routers' OpenAI HTTP URLs
    prometheus_url: str | None = None  # the cluster's Prometheus (None: none started)
    prometheus_pid: int | None = None  # its process group, if ``up`` started it

    def save(self) -> Path:
        """Write the state file, readable by its owner only (the Redis URL may hold a
        password)."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        path = STATE_DIR / f"{self.name}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(self), indent=2))
        path.chmod(0o600)  # os.open's mode applies only when it creates the file
        return path

    @classmethod
    def load(cls, name: str) -> ClusterState:
        path = STATE_DIR / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(
                f"no running cluster {name!r} ({path} missing): start one with `kvcluster up`"
            )
        return cls(**json.loads(path.read_text()))

    def endpoint(self, api: str = "grpc") -> str:
        """Every router's gRPC host:port, comma-separated (the client spreads its calls over
        them and fails over), or with ``api="http"`` the first router's OpenAI API URL."""
        if api == "http":
            if not self.http_endpoints:
                raise ConfigError("the cluster serves no HTTP API (router.http_port is null)")
            return self.http_endpoints[0]
        return ",".join(self.endpoints)


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group ``pgid`` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# A Ray head that has served a driver keeps its ``ray start``, gcs_server and log monitor
# past SIGTERM (Ray 2.60; a fresh head exits in ~0.2 s). Its actors are killed before it is
# stopped, so nothing is lost by the SIGKILL that follows this grace.
RAY_HEAD_GRACE_S = 2.0


def stop_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM a process group we started (Ray head, detached redis-server); SIGKILL what is
    left after ``grace_s`` (``ray start --block`` does not always exit on SIGTERM)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.1)
        if not group_alive(pgid):
            return
