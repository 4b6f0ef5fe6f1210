"""A Prometheus for the cluster: Debian's ``prometheus`` binary on a free loopback port,
scraping Ray's metrics export and every router's ``/metrics``, with the alert rules of
``deploy/prometheus/alerts.yaml``.

Targets come from files Prometheus re-reads on its own (file-based service discovery):

* Ray's: the service-discovery file Ray's dashboard writes into the session folder every
  few seconds (one target per node's metrics agent, plus the autoscaler and the dashboard),
  and a file of the nodes' metrics agents this module writes itself when Prometheus starts
  (a Ray without its dashboard process writes none);
* the routers': a file of their HTTP ``host:port`` the launcher writes once they serve.

Ray's dashboard reads Prometheus through ``RAY_PROMETHEUS_HOST``, which must be in its
environment when Ray starts: :meth:`LocalPrometheus.point_ray_at` sets it in this process
(the Ray it starts inherits it). Its Metrics page draws charts once a Grafana is set too
(``RAY_GRAFANA_HOST``); the dashboards of ``deploy/grafana/`` fit either.

On a ``ray up`` head, ``kvcluster up`` starts it on port 9090, where the head's ``ray start``
pointed the dashboard (``deploy/local.yaml``). ``python -m cluster.prometheus`` starts one on
its own (e.g. before ``ray start``, on a head whose clusters come and go); a ``kvcluster up``
configured with its port and data folder then uses it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from cluster import state
from cluster.config import ClusterConfig, PrometheusConfig
from cluster.local_redis import free_port

log = logging.getLogger("cluster.launcher")

RAY_SD_FILE = "prom_metrics_service_discovery.json"  # Ray's name, in its session folder
RAY_PROMETHEUS_HOST = "RAY_PROMETHEUS_HOST"  # the dashboard's setting for its Prometheus
ALERT_RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yaml"
MISSING = (
    "prometheus not found on PATH: the cluster's metrics are not collected (install it: "
    "apt-get install prometheus, or bash deploy/dev.sh install)"
)


class LocalPrometheus:
    """Owns one ``prometheus`` process, its config and its target files under ``data_dir``."""

    def __init__(self, cfg: PrometheusConfig, data_dir: Path, binary: str) -> None:
        self.cfg = cfg
        self.binary = binary
        self.data_dir = data_dir
        self.port = cfg.port or free_port(cfg.host)
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def for_cluster(cls, cfg: ClusterConfig, *, detached: bool) -> LocalPrometheus | None:
        """The cluster's Prometheus as ``cfg.prometheus.start`` asks (``up``: detached
        clusters only), or None; a missing binary is one warning, never an error."""
        p = cfg.prometheus
        if p.start == "never" or (p.start == "up" and not detached):
            return None
        binary = shutil.which("prometheus")
        if binary is None:
            log.warning(MISSING)
            return None
        data_dir = Path(p.data_dir) if p.data_dir else state.STATE_DIR / f"prometheus-{cfg.name}"
        return cls(p, data_dir.expanduser(), binary)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.data_dir / "prometheus.yml"

    @property
    def routers_file(self) -> Path:
        return self.data_dir / "targets" / "routers.json"

    @property
    def ray_nodes_file(self) -> Path:
        return self.data_dir / "targets" / "ray-nodes.json"

    def point_ray_at(self) -> None:
        """Ray's dashboard reads this Prometheus (for the Ray this process starts next; a
        value the user set stays)."""
        os.environ.setdefault(RAY_PROMETHEUS_HOST, self.url)

    def config(self, ray_session_dir: Path | None) -> dict:
        """The Prometheus config: Ray's targets, the routers', the alert rules."""
        interval = f"{round(self.cfg.scrape_interval_s * 1000)}ms"  # whole units only
        ray_files = [str(self.ray_nodes_file)]
        if ray_session_dir is not None:
            ray_files.append(str(ray_session_dir / RAY_SD_FILE))
        refresh = {"refresh_interval": interval}
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(ALERT_RULES)] if ALERT_RULES.is_file() else [],
            "scrape_configs": [
                {"job_name": "ray", "file_sd_configs": [{"files": ray_files, **refresh}]},
                {
                    "job_name": "kvcluster-routers",
                    "file_sd_configs": [{"files": [str(self.routers_file)], **refresh}],
                },
            ],
        }

    def write_config(self, ray_session_dir: Path | None) -> None:
        self.routers_file.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.routers_file, self.ray_nodes_file):
            if not path.exists():
                _write_targets(path, [], "")
        self.config_file.write_text(yaml.safe_dump(self.config(ray_session_dir)))

    def set_routers(self, http_urls: list[str]) -> None:
        """Scrape these routers' ``/metrics`` (their HTTP base URLs)."""
        targets = [u.split("://", 1)[-1].rstrip("/") for u in http_urls]
        _write_targets(self.routers_file, targets, "kvcluster-routers")

    def set_ray_nodes(self, addresses: list[str]) -> None:
        """Scrape these Ray metrics agents (``host:port``)."""
        _write_targets(self.ray_nodes_file, addresses, "ray")

    def start(
        self, ray_session_dir: Path | None, *, detach: bool = False, timeout_s: float = 30.0
    ) -> LocalPrometheus:
        """Write the config and start the server; wait until it answers ``/-/ready``.
        ``detach``: in a session of its own, outliving this process (``kvcluster up``).
        With a fixed port where a Prometheus already answers (a ``ray up`` head's, on the
        same data folder), that one is used: only the target files are written."""
        if self.cfg.port and self.config_file.as_posix() == self._served_config():
            return self
        self.write_config(ray_session_dir)
        tsdb = self.data_dir / "data"
        tsdb.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={tsdb}",
            f"--storage.tsdb.retention.time={self.cfg.retention}",
            f"--web.listen-address={self.cfg.host}:{self.port}",
            "--web.enable-lifecycle",
        ]
        with open(self.data_dir / "prometheus.log", "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=detach
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self.proc.returncode} (is {self.cfg.host}:"
                    f"{self.port} taken? set prometheus.port); see "
                    f"{self.data_dir / 'prometheus.log'}"
                )
            if self.ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not answer on {self.url} within {timeout_s:.0f}s")

    def serve(self, router_urls: list[str], *, detach: bool = False) -> LocalPrometheus:
        """Start (or use) it for the connected Ray and these routers' HTTP base URLs."""
        self.start(ray_session_dir(), detach=detach)
        self.set_ray_nodes(ray_metrics_agents())
        self.set_routers(router_urls)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as r:  # noqa: S310
                return r.status == 200
        except OSError:
            return False

    def _served_config(self) -> str | None:
        """The config file of the Prometheus answering on this port, if any."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/status/flags", timeout=1.0) as r:  # noqa: S310
                return json.load(r)["data"]["config.file"]
        except (OSError, ValueError, KeyError):
            return None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def forget(self) -> None:
        """Leave the (detached) server running; ``kvcluster down`` stops it by pid."""
        self.proc = None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _write_targets(path: Path, targets: list[str], job: str) -> None:
    """A file_sd target file, replaced atomically (Prometheus may read it at any time)."""
    groups = [{"targets": targets, "labels": {"job": job}}] if targets else []
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)


def ray_session_dir() -> Path | None:
    """The connected Ray's session folder on this machine (the head's, where Ray writes its
    service-discovery file), or None when this process is not connected to a local Ray."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if not ray.is_initialized() or node is None:
        return None
    return Path(node.get_session_dir_path())


def ray_metrics_agents() -> list[str]:
    """``host:port`` of every live node's metrics agent (what Ray's own file lists)."""
    import ray

    return [
        f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}"
        for n in ray.nodes()
        if n.get("Alive") and n.get("MetricsExportPort")
    ]


def main(argv: list[str] | None = None) -> int:
    """A detached Prometheus of its own for a Ray head (Ray's service-discovery file read
    from ``--ray-session-dir``, by default the latest session's); prints its URL."""
    p = argparse.ArgumentParser(prog="python -m cluster.prometheus", description=main.__doc__)
    p.add_argument("--port", type=int, default=9090)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(  # the folder `kvcluster up` of the default cluster name uses
        "--data-dir", default=str(state.STATE_DIR / f"prometheus-{ClusterConfig().name}")
    )
    p.add_argument("--retention", default=PrometheusConfig().retention)
    p.add_argument("--ray-session-dir", default="/tmp/ray/session_latest")
    args = p.parse_args(argv)
    cfg = PrometheusConfig(start="up", host=args.host, port=args.port, retention=args.retention)
    binary = shutil.which("prometheus")
    if binary is None:
        print(MISSING, file=sys.stderr)
        return 0
    prom = LocalPrometheus(cfg, Path(args.data_dir), binary)
    if prom.ready():
        print(f"prometheus already serving at {prom.url}")
        return 0
    prom.start(Path(args.ray_session_dir), detach=True)
    print(f"prometheus at {prom.url} (pid {prom.pid})")
    prom.forget()
    return 0


if __name__ == "__main__":
    sys.exit(main())
