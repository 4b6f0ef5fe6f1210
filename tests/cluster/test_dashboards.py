"""The shipped Grafana dashboards: generated from cluster/dashboards.py, valid Grafana JSON,
and every panel's query reads only metrics the code defines."""

from __future__ import annotations

import json

import pytest

from cluster import dashboards
from tests.cluster.metric_names import defined_names, metric_names


def test_parser_finds_the_metrics_of_a_query() -> None:
    q = (
        'histogram_quantile(0.99, sum by (le, worker) (rate(a:b_bucket{x="y"}[5m]))) '
        "/ ignoring(stage) group_left sum(c_total) or vector(0) > bool 1"
    )
    assert metric_names(q) == {"a:b_bucket", "c_total"}


def test_the_files_are_generated_from_the_one_source() -> None:
    for d in dashboards.DASHBOARDS:
        path = dashboards.OUT_DIR / f"{d.uid}.json"
        assert path.read_text() == dashboards.render(d), (
            f"{path} is stale: run python -m cluster.dashboards"
        )


def test_dashboards_are_grafana_models() -> None:
    uids = set()
    for d in dashboards.DASHBOARDS:
        model = json.loads(dashboards.render(d))
        uids.add(model["uid"])
        assert model["templating"]["list"][0]["type"] == "datasource"
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)) >= 3
        for p in model["panels"]:
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    assert len(uids) == 3


def test_every_panel_reads_metrics_the_code_defines(monkeypatch: pytest.MonkeyPatch) -> None:
    defined = defined_names(monkeypatch)
    missing = [
        f"{d.uid} / {p.title}: {name}"
        for d, p, expr in dashboards.queries()
        for name in sorted(metric_names(expr))
        if name not in defined
    ]
    assert not missing, missing


def test_a_panel_naming_an_undefined_metric_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    defined = defined_names(monkeypatch)
    assert "vllm:time_to_first_token_seconds_bucket" in defined
    assert "ray_kvc_ttft_seconds_bucket" in defined  # a worker's, through Ray
    assert metric_names("sum(rate(vllm:no_such_metric_total[1m]))") - defined
