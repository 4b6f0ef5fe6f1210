"""Against the real thing: a cluster on the session's Ray with its own Prometheus (scraping
Ray's export and the router every second), traffic with shared prefixes, then every panel of
every shipped dashboard evaluated through Prometheus's HTTP API: each returns data. One
headless-Chromium screenshot of Prometheus's graph page for a kvcluster query shows a drawn
series."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from cluster import dashboards
from cluster.client import KVClusterClient
from cluster.launcher import Cluster
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import shared_ray

pytestmark = [
    pytest.mark.ray,
    pytest.mark.redis,
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="prometheus not installed (deploy/dev.sh)"
    ),
]

WINDOW = "30s"  # for Grafana's $__rate_interval: 30 scrapes at 1 s
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SYSTEM = "You are a terse assistant of the observability test. " * 6  # a shared prefix


def query(url: str, expr: str) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as r:  # noqa: S310
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


class Traffic:
    """Requests with shared prefixes, one after another, until stopped."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with KVClusterClient(self.endpoint) as client:
            while not self._stop.is_set():
                client.generate(f"{SYSTEM} question {self.sent % 4}", max_tokens=4)
                self.sent += 1
                self._stop.wait(0.2)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@pytest.fixture(scope="module")
def watched() -> Cluster:
    shared_ray()
    # a host tier and speculation, so the tier and speculative panels have series to show
    engine = {**ENGINE, "host_kv_bytes": 4 << 20, "speculative": {"method": "ngram"}}
    cfg = cluster_config(
        f"watch-{os.getpid()}",
        prometheus={"start": "always", "scrape_interval_s": 1.0},
        workers={"engine": engine},
    )
    with Cluster(cfg) as c:
        yield c


def test_every_dashboard_panel_returns_data(watched: Cluster) -> None:
    prom = watched.prometheus
    assert prom is not None and prom.ready()
    window = "$__rate_interval"
    empty = [(d.uid, p.title, e.replace(window, WINDOW)) for d, p, e in dashboards.queries()]
    with Traffic(watched.endpoints[0]) as traffic:
        deadline = time.monotonic() + 120  # Ray exports application metrics every ~10 s
        while empty and time.monotonic() < deadline:
            time.sleep(2)
            empty = [(uid, title, e) for uid, title, e in empty if not query(prom.url, e)]
    assert traffic.sent >= 4
    assert not empty, "panels without data:\n" + "\n".join(map(str, empty))


FUNNEL = "sum by (stage) (kvc_cache_funnel_tokens_total)"
PLOT = (240, 340, 1220, 745)  # the graph's plot area at 1280x900, left of its legend


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (deploy/dev.sh)")
def test_prometheus_graph_page_draws_a_kvcluster_series(watched: Cluster, tmp_path: Path) -> None:
    """Prometheus's own graph page, in headless Chromium, draws the cache funnel: its plot
    area holds coloured lines, where the same page for a query without data holds none."""
    prom = watched.prometheus
    assert prom is not None
    deadline = time.monotonic() + 60
    while not query(prom.url, FUNNEL) and time.monotonic() < deadline:
        time.sleep(1)
    drawn = _coloured(_shoot(prom.url, FUNNEL, tmp_path / "funnel.png"))
    blank = _coloured(_shoot(prom.url, "kvc_no_such_series", tmp_path / "blank.png"))
    assert blank < 50 and drawn > 300, (drawn, blank)


def _coloured(png: Path) -> int:
    """Strongly coloured pixels in the plot area (the page around it is grey and white)."""
    from PIL import Image

    data = Image.open(png).convert("RGB").crop(PLOT).tobytes()
    return sum(
        1
        for rgb in zip(data[0::3], data[1::3], data[2::3], strict=True)
        if max(rgb) - min(rgb) > 60
    )


def _shoot(url: str, expr: str, out: Path) -> Path:
    page = f"{url}/graph?" + urllib.parse.urlencode(
        {"g0.expr": expr, "g0.tab": "0", "g0.range_input": "5m"}
    )
    subprocess.run(
        [
            CHROMIUM or "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,900",
            "--virtual-time-budget=8000",
            f"--screenshot={out}",
            page,
        ],
        capture_output=True,
        timeout=90,
        check=True,
    )
    return out
