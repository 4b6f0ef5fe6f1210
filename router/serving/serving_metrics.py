"""The router's serving metrics in Prometheus text (``GET /metrics`` on the HTTP port), under
kvcluster's names and, where the meaning matches, vLLM's (``vllm:...``), so dashboards,
autoscalers and routers built on vLLM's metrics read a kvcluster cluster unchanged.

Latencies and token counts are measured here, at the router, per worker it routed to;
queue and KV gauges come from the workers' statuses at scrape time. Each router exports
what it served (sum over routers for the cluster, as over vLLM replicas).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.blocks.outputs import RequestOutput
from kvstore.blocks.protocol import WorkerStatus
from router.serving.loop_histograms import LoopHistogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
MAX_FIELD_LABELS = 64  # distinct unknown field names counted by name; the rest as "<other>"


class _Statuses(Collector):
    """Per-worker gauges from the statuses read at scrape time."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.statuses: Sequence[WorkerStatus] = ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model_name", "worker"]
        fams = {
            name: GaugeMetricFamily(name, help_, labels=labels)
            for name, help_ in (
                ("vllm:num_requests_running", "Requests in the worker's running batch."),
                ("vllm:num_requests_waiting", "Requests waiting in the worker's queue."),
                ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)."),
                ("kvc_worker_free_blocks", "Free KV blocks of the worker."),
                ("kvc_worker_total_blocks", "KV blocks of the worker."),
                ("kvc_worker_queued_prefill_tokens", "Prompt tokens still to prefill."),
                (
                    "kvc_worker_waiting_pinned_blocks",
                    "Cached KV blocks the worker's waiting requests will pin when admitted.",
                ),
                ("kvc_worker_prefix_hit_rate", "The worker's prefix cache hit rate."),
                ("kvc_worker_alive", "1 when the worker answered its status call."),
            )
        }
        for s in self.statuses:
            v = [self.model, s.worker_id]
            usage = 1 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0
            for name, value in (
                ("vllm:num_requests_running", s.running),
                ("vllm:num_requests_waiting", s.waiting),
                ("vllm:kv_cache_usage_perc", usage),
                ("kvc_worker_free_blocks", s.free_blocks),
                ("kvc_worker_total_blocks", s.total_blocks),
                ("kvc_worker_queued_prefill_tokens", s.queued_prefill_tokens),
                ("kvc_worker_waiting_pinned_blocks", s.waiting_pinned_blocks),
                ("kvc_worker_prefix_hit_rate", s.prefix_hit_rate),
                ("kvc_worker_alive", 0 if s.stale else 1),
            ):
                fams[name].add_metric(v, float(value))
        yield from fams.values()


class _Routing(Collector):
    """The router's own counters (placement decisions, retries), read at scrape time: the
    names Ray's exporter gives them (``router/serving/metrics_exporter.py``)."""

    def __init__(self) -> None:
        self.snapshot: dict = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        snap = self.snapshot
        routed = CounterMetricFamily(
            "kvc_routed_requests",
            "Requests routed, by policy and reason.",
            labels=["policy", "reason"],
        )
        for label, n in (snap.get("decisions") or {}).items():
            routed.add_metric(label.split("/", 1), float(n))
        yield routed
        for name, help_ in (
            ("index_errors", "Index lookups that failed (routed by load)."),
            ("parity_mismatches", "Router/worker block key mismatches."),
            ("retries", "Requests retried after a worker died."),
            ("broken_streams", "Streams ended by a worker death."),
        ):
            yield CounterMetricFamily(f"kvc_router_{name}", help_, value=float(snap.get(name, 0)))
        moved = CounterMetricFamily(
            "kvc_migrations",
            "Streams moved to another worker after theirs died mid-stream, by reason.",
            labels=["reason"],
        )
        for reason, n in (snap.get("migrations") or {}).items():
            moved.add_metric([reason], float(n))
        yield moved


class ServingMetrics:
    """What one router served; :meth:`render` is the ``/metrics`` body."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=False)
        r, by_worker = self.registry, ("model_name", "worker")
        self._statuses = _Statuses(model)
        r.register(self._statuses)
        self._routing = _Routing()
        r.register(self._routing)
        self.ttft = LoopHistogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, from the request's arrival at the router.",
            by_worker,
            _TTFT_BUCKETS,
            r,
        )
        self.itl = LoopHistogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens (a message of k tokens counts k gaps).",
            by_worker,
            _ITL_BUCKETS,
            r,
        )
        self.e2e = LoopHistogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            by_worker,
            _E2E_BUCKETS,
            r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens served.", by_worker, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", by_worker, registry=r
        )
        self.cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            by_worker,
            registry=r,
        )
        self.cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            by_worker,
            registry=r,
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            ("model_name", "worker", "finished_reason"),
            registry=r,
        )
        self.failures = Counter(
            "kvc_request_errors",
            "Requests answered with an error, by the HTTP status of the error table "
            "(both edges: a gRPC error counts under its HTTP equivalent).",
            ("status",),
            registry=r,
        )
        self.unknown_fields = Counter(
            "kvc_http_unknown_fields",
            "Request fields this server does not know (accepted and ignored), by name.",
            ("field",),
            registry=r,
        )
        self._field_labels: set[str] = set()
        self._by_worker: dict[str, _WorkerSeries] = {}

    def unknown_field(self, name: str) -> bool:
        """Counts one unknown field; True the first time this name is seen (log it then).
        At most :data:`MAX_FIELD_LABELS` names get a label of their own."""
        first = name not in self._field_labels
        if first and len(self._field_labels) >= MAX_FIELD_LABELS:
            self.unknown_fields.labels("<other>").inc()
            return False
        self._field_labels.add(name)
        self.unknown_fields.labels(name).inc()
        return first

    def tracker(self) -> RequestTimer:
        return RequestTimer(self)

    def of_worker(self, worker: str) -> _WorkerSeries:
        """The series of one worker, labelled once: ``labels()`` costs more than the
        observation itself, and the timer observes every token."""
        series = self._by_worker.get(worker)
        if series is None:
            series = self._by_worker[worker] = _WorkerSeries(self, worker)
        return series

    def render(self, statuses: Sequence[WorkerStatus], routing: dict | None = None) -> bytes:
        """``routing``: the router's counters (RouterMetrics.snapshot plus retries,
        broken_streams and migrations by reason)."""
        self._statuses.statuses = statuses
        self._routing.snapshot = routing or {}
        return generate_latest(self.registry)


class _WorkerSeries:
    """One worker's labelled children of the per-request series."""

    __slots__ = (
        "ttft",
        "itl",
        "e2e",
        "prompt_tokens",
        "generation_tokens",
        "cache_queries",
        "cache_hits",
        "worker",
        "_success",
        "_m",
    )

    def __init__(self, m: ServingMetrics, worker: str) -> None:
        labels = (m.model, worker)
        self.ttft = m.ttft.labels(*labels)
        self.itl = m.itl.labels(*labels)
        self.e2e = m.e2e.labels(*labels)
        self.prompt_tokens = m.prompt_tokens.labels(*labels)
        self.generation_tokens = m.generation_tokens.labels(*labels)
        self.cache_queries = m.cache_queries.labels(*labels)
        self.cache_hits = m.cache_hits.labels(*labels)
        self._success: dict[str, Counter] = {}
        self._m, self.worker = m, worker

    def success(self, reason: str) -> Counter:
        child = self._success.get(reason)
        if child is None:
            m = self._m
            child = self._success[reason] = m.success.labels(m.model, self.worker, reason)
        return child


class RequestTimer:
    """One request's timings, fed each output as it reaches the router."""

    __slots__ = ("m", "start", "last", "tokens", "_series")

    def __init__(self, m: ServingMetrics) -> None:
        self.m = m
        self.start = self.last = time.monotonic()
        self.tokens = 0
        self._series: _WorkerSeries | None = None  # of the worker that answers

    def output(self, worker: str, out: RequestOutput) -> None:
        now = time.monotonic()
        s = self._series
        if s is None or s.worker != worker:  # the first output, or a retry elsewhere
            s = self._series = self.m.of_worker(worker)
        k = sum(len(d.token_ids) for d in out.outputs)
        if k:
            if self.tokens == 0:
                s.ttft.observe(now - self.start)
                k_gaps, gap_from = k - 1, now
            else:
                k_gaps, gap_from = k, self.last
            if k_gaps:
                s.itl.observe((now - gap_from) / k_gaps, k_gaps)
            self.tokens += k
            self.last = now
        if out.finished:
            u = out.usage
            s.e2e.observe(now - self.start)
            s.prompt_tokens.inc(u.prompt_tokens)
            s.generation_tokens.inc(u.completion_tokens)
            s.cache_queries.inc(u.prompt_tokens)
            s.cache_hits.inc(u.cached_tokens)
            reasons = {d.finish_reason.value for d in out.outputs if d.finish_reason}
            s.success(next(iter(reasons), "stop")).inc()
