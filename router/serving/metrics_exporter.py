"""Router metrics exported through ``ray.util.metrics`` (Ray's Prometheus endpoint).

The router's in-process :class:`RouterMetrics` stays the source of truth; every
``interval_s`` the exporter pushes what changed: routed requests per (policy, reason),
decision latency, index errors, parity mismatches, retries, broken streams and
migrations by reason (``kvc_migrations_total``); and per
worker the cached tokens predicted and realised, their gap and the misses and resyncs
(:mod:`router.placement.prediction`).
"""

from __future__ import annotations

import asyncio
import contextlib

import ray

from router.placement.prediction import GAP_BUCKETS_TOKENS, PredictionTracker
from router.placement.router_metrics import RouterMetrics


class RouterExporter:
    def __init__(
        self,
        router_id: str,
        metrics: RouterMetrics,
        extra: callable,  # type: ignore[valid-type]
        predictions: PredictionTracker | None = None,
    ) -> None:
        from ray.util import metrics as m

        self.metrics = metrics
        self.predictions = predictions
        self._gaps_seen: dict[str, int] = {}  # worker -> placements already exported
        # () -> dict of counters (retries, broken_streams, migrations: reason -> count)
        self.extra = extra
        self.tags = {"router": router_id}
        self._sent: dict[str, float] = {}
        self._latency_seen = 0
        self.routed = m.Counter(
            "kvc_routed_requests",
            "Requests routed, by policy and reason.",
            tag_keys=("router", "policy", "reason"),
        )
        self.latency = m.Histogram(
            "kvc_route_decision_seconds",
            "Routing decision latency.",
            boundaries=[1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1],
            tag_keys=("router",),
        )
        self.migrations = m.Counter(
            "kvc_migrations",
            "Streams moved to another worker after theirs died mid-stream, by reason.",
            tag_keys=("router", "reason"),
        )
        self.counters = {
            name: m.Counter(f"kvc_router_{name}", help_, tag_keys=("router",))
            for name, help_ in (
                ("index_errors", "Index lookups that failed (routed by load)."),
                ("parity_mismatches", "Router/worker block key mismatches."),
                ("retries", "Requests retried after a worker died."),
                ("broken_streams", "Streams ended by a worker death."),
            )
        }

        by_worker = ("router", "worker")
        self.per_worker = {
            name: m.Counter(f"kvc_route_{name}", help_, tag_keys=by_worker)
            for name, help_ in (
                ("predicted_cached_tokens", "Cached prompt tokens the router predicted."),
                ("realised_cached_tokens", "Cached prompt tokens the worker realised."),
                (
                    "prediction_misses",
                    "Placements whose predicted and realised cached "
                    "tokens differed by a block or more.",
                ),
                ("index_resyncs", "Resyncs of a worker's index entries asked by the router."),
            )
        }
        self.gap = m.Histogram(
            "kvc_route_cache_gap_tokens",
            "|predicted - realised| cached prompt tokens per placement.",
            boundaries=GAP_BUCKETS_TOKENS[1:],
            tag_keys=by_worker,
        )

    def export(self) -> None:
        self._export_predictions()
        snap = self.metrics.snapshot()
        for label, n in snap["decisions"].items():  # type: ignore[union-attr]
            self._inc(
                self.routed,
                f"d:{label}",
                n,
                dict(zip(("policy", "reason"), label.split("/", 1), strict=True)),
            )
        values = {**{k: snap[k] for k in ("index_errors", "parity_mismatches")}, **self.extra()}
        for name, counter in self.counters.items():
            self._inc(counter, name, values.get(name, 0), {})
        for reason, n in (values.get("migrations") or {}).items():
            self._inc(self.migrations, f"m:{reason}", n, {"reason": reason})
        hist = self.metrics.latency
        new = hist.count - self._latency_seen
        if new > 0:
            for v in hist.latest(new):
                self.latency.observe(v, self.tags)
            self._latency_seen = hist.count

    def _export_predictions(self) -> None:
        if self.predictions is None:
            return
        for w, p in list(self.predictions.workers.items()):
            tags = {"worker": w}
            for name, total in (
                ("predicted_cached_tokens", p.predicted_tokens),
                ("realised_cached_tokens", p.realised_tokens),
                ("prediction_misses", p.misses),
                ("index_resyncs", p.resyncs),
            ):
                self._inc(self.per_worker[name], f"p:{name}:{w}", total, tags)
            new = p.placements - self._gaps_seen.get(w, 0)
            if new > 0:  # the most recent gaps (older ones beyond the window are not seen)
                for gap in list(p.recent)[-new:]:
                    self.gap.observe(abs(gap), {**self.tags, **tags})
                self._gaps_seen[w] = p.placements

    def _inc(self, counter, key: str, total: float, tags: dict) -> None:  # noqa: ANN001
        delta = total - self._sent.get(key, 0)
        if delta > 0:
            counter.inc(delta, {**self.tags, **tags})
            self._sent[key] = total

    async def run(self, interval_s: float = 2.0) -> None:
        while True:
            with contextlib.suppress(Exception):  # metrics must never take the router down
                self.export()
            await asyncio.sleep(interval_s)


def start_exporter(
    router_id: str,
    metrics: RouterMetrics,
    extra,  # noqa: ANN001
    predictions: PredictionTracker | None = None,
) -> asyncio.Task | None:
    if not ray.is_initialized():
        return None
    exporter = RouterExporter(router_id, metrics, extra, predictions)
    return asyncio.get_running_loop().create_task(exporter.run())
