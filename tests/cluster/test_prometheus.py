"""The cluster's Prometheus (cluster/prometheus.py): when it starts, its config, and a real
``prometheus`` scraping a router's target file."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from cluster import prometheus as prom_mod
from cluster.config import ClusterConfig, ConfigError, PrometheusConfig, load_config
from cluster.prometheus import RAY_PROMETHEUS_HOST, RAY_SD_FILE, LocalPrometheus

HAVE_PROMETHEUS = shutil.which("prometheus") is not None


def test_start_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prom_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    up = ClusterConfig()
    assert LocalPrometheus.for_cluster(up, detached=False) is None  # in-process: not by default
    assert LocalPrometheus.for_cluster(up, detached=True) is not None
    always = ClusterConfig(prometheus={"start": "always"})
    assert LocalPrometheus.for_cluster(always, detached=False) is not None
    never = ClusterConfig(prometheus={"start": "never"})
    assert LocalPrometheus.for_cluster(never, detached=True) is None


def test_missing_binary_is_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(prom_mod.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="cluster.launcher"):
        assert LocalPrometheus.for_cluster(ClusterConfig(), detached=True) is None
    assert [r.getMessage() for r in caplog.records] == [prom_mod.MISSING]


def test_config_scrapes_ray_and_routers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = PrometheusConfig(port=9999, scrape_interval_s=2, data_dir=str(tmp_path))
    p = LocalPrometheus(cfg, tmp_path, "prometheus")
    assert p.url == "http://127.0.0.1:9999"
    conf = p.config(Path("/tmp/ray/session_x"))
    assert conf["global"]["scrape_interval"] == "2000ms"
    jobs = {j["job_name"]: j["file_sd_configs"][0]["files"] for j in conf["scrape_configs"]}
    assert jobs["ray"] == [str(p.ray_nodes_file), f"/tmp/ray/session_x/{RAY_SD_FILE}"]
    assert jobs["kvcluster-routers"] == [str(p.routers_file)]
    assert conf["rule_files"] == [str(prom_mod.ALERT_RULES)]
    monkeypatch.delenv(RAY_PROMETHEUS_HOST, raising=False)
    p.point_ray_at()
    assert os.environ[RAY_PROMETHEUS_HOST] == p.url


def test_config_keys_are_checked() -> None:
    with pytest.raises(ValueError, match="retention"):
        PrometheusConfig(retention="two weeks")
    with pytest.raises(ValueError, match="extra"):
        PrometheusConfig(data_directory="/x")


def test_deploy_config_points_at_the_heads_prometheus(tmp_path: Path) -> None:
    assert load_config("deploy/kvcluster.yaml").prometheus.port == 9090
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump({"prometheus": {"retention": "forever"}}))
    with pytest.raises(ConfigError, match="prometheus.retention"):
        load_config(bad)


class _Router(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"# TYPE kvc_test_up gauge\nkvc_test_up 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.skipif(not HAVE_PROMETHEUS, reason="prometheus not installed (deploy/dev.sh)")
def test_real_prometheus_scrapes_router_targets(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = PrometheusConfig(start="always", scrape_interval_s=0.5)
    p = LocalPrometheus(cfg, tmp_path, shutil.which("prometheus") or "")
    try:
        p.start(None)
        p.set_routers([f"http://127.0.0.1:{server.server_address[1]}"])
        again = LocalPrometheus(cfg.model_copy(update={"port": p.port}), tmp_path, p.binary)
        assert again.start(None).pid is None  # the one serving this data folder is used
        deadline, result = time.monotonic() + 30, []
        while time.monotonic() < deadline and not result:
            url = f"{p.url}/api/v1/query?query=kvc_test_up"
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310
                result = json.load(r)["data"]["result"]
            time.sleep(0.3)
        assert result and result[0]["metric"]["job"] == "kvcluster-routers"
    finally:
        p.stop()
        server.shutdown()
    assert not p.ready()


@pytest.mark.skipif(not HAVE_PROMETHEUS, reason="prometheus not installed (deploy/dev.sh)")
def test_a_ray_up_head_starts_one_that_outlives_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cluster.local_redis import free_port
    from cluster.state import group_alive, stop_group

    port = free_port()
    args = ["--port", str(port), "--data-dir", str(tmp_path), "--ray-session-dir", str(tmp_path)]
    assert prom_mod.main(args) == 0
    out = capsys.readouterr().out
    pid = int(out.rsplit("pid ", 1)[1].rstrip(")\n"))
    try:
        assert f"prometheus at http://127.0.0.1:{port}" in out
        assert prom_mod.main(args) == 0  # the head's start commands run again: left as it is
        assert "already serving" in capsys.readouterr().out
        conf = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
        assert (
            str(tmp_path / RAY_SD_FILE) in conf["scrape_configs"][0]["file_sd_configs"][0]["files"]
        )
    finally:
        stop_group(pid)
    assert not group_alive(pid)
