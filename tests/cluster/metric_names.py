"""The metric names the code defines, collected from its registries, and the names a PromQL
query reads (for the dashboards' and alert rules' checks)."""

from __future__ import annotations

import re
from types import SimpleNamespace

from prometheus_client.registry import CollectorRegistry

from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from router.placement.placement_types import Reason, RouteDecision
from router.placement.prediction import PredictionTracker
from router.placement.router_metrics import RouterMetrics
from router.serving.cache_funnel import CacheFunnel
from router.serving.request_phases import RequestPhases
from router.serving.serving_metrics import ServingMetrics
from tests.router.serving.test_status_surfaces import STATUS

# Prometheus's own series for each target (1: the last scrape succeeded)
PROMETHEUS_SYNTHETIC = {"up"}
# how each kind of metric appears in a scrape (prometheus_client's and Ray's exposition)
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "unknown": ("",),
}
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip


def _sample_names(registry: CollectorRegistry) -> set[str]:
    out = set()
    for fam in registry.collect():
        out |= {fam.name + s for s in SUFFIXES[fam.type]}
        out |= {s.name for s in fam.samples}
    return out


def router_metrics() -> set[str]:
    """Every series a router's ``/metrics`` can carry."""
    m = ServingMetrics("m")
    funnel = CacheFunnel()
    decision = RouteDecision("w0", "p", Reason.PREFIX, 16, 0.0)
    funnel.observe(decision, Usage(32, 16, 1), None)
    tracker = PredictionTracker(16)
    tracker.observe("w0", 16, 16)
    tracker.observe_pull("w0", 16, 16, seconds=0.1, priced_s=0.1, slow_factor=2.0)
    m.read_core(funnel, tracker, RequestPhases())
    timer = m.tracker()
    last = CompletionDelta(0, "x", [1], finish_reason=FinishReason.STOP)
    timer.output("w0", RequestOutput("r", [last], True, Usage(1, 0, 1)))
    m.render([STATUS], {**RouterMetrics().snapshot(), "retries": 0, "broken_streams": 0})
    return _sample_names(m.registry)


class _Recorder:
    """Stands in for ``ray.util.metrics``: records each metric's kind and name."""

    def __init__(self) -> None:
        self.defined: set[tuple[str, str]] = set()

        def kind(k: str):  # noqa: ANN202
            def make(name: str, *args: object, **kwargs: object) -> SimpleNamespace:
                self.defined.add((k, name))
                return SimpleNamespace(
                    inc=lambda *a, **kw: None,
                    set=lambda *a, **kw: None,
                    observe=lambda *a, **kw: None,
                )

            return make

        self.Counter, self.Gauge, self.Histogram = kind("counter"), kind("gauge"), kind("histogram")


def ray_exported(monkeypatch) -> set[str]:  # noqa: ANN001
    """What the workers and routers export through Ray (``ray_<name>`` in Ray's export) and
    Ray's own node metrics."""
    import ray.util.metrics  # noqa: F401 - a submodule: loaded before it is replaced

    from router.serving.metrics_exporter import RouterExporter
    from worker.telemetry import WorkerTelemetry

    rec = _Recorder()
    WorkerTelemetry("w0", metrics_api=rec)  # type: ignore[arg-type]
    monkeypatch.setattr("ray.util.metrics", rec)
    RouterExporter("router-0", RouterMetrics(), dict, PredictionTracker(16))
    names = {f"ray_{name}{s}" for k, name in rec.defined for s in SUFFIXES[k]}
    from ray.dashboard.modules.reporter.reporter_agent import METRICS_GAUGES

    return names | {f"ray_{name}" for name in METRICS_GAUGES}


def defined_names(monkeypatch) -> set[str]:  # noqa: ANN001
    return router_metrics() | ray_exported(monkeypatch) | PROMETHEUS_SYNTHETIC


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range and subquery windows
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", s):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names
