"""The router's serving metrics in Prometheus text (``GET /metrics`` on the HTTP port), under
kvcluster's names and, where the meaning matches, vLLM's (``vllm:...``), so dashboards,
autoscalers and routers built on vLLM's metrics read a kvcluster cluster unchanged.

Latencies and token counts are measured here, at the router, per worker it routed to;
queue and KV gauges, and the histograms measured in the engine (queue, prefill, decode and
inference times; KV block residency), come from the workers' statuses at scrape time: every
router exports every worker's, so a query takes the ``max by (worker)`` of those. Each router
exports what it served (sum over routers for the cluster, as over vLLM replicas).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvstore.requests.outputs import RequestOutput
from kvstore.requests.protocol import WAIT_REASONS, WorkerStatus
from router.placement.prediction import PredictionTracker
from router.serving.cache_funnel import STAGES, CacheFunnel
from router.serving.loop_histograms import LoopHistogram, cumulative
from router.serving.request_phases import RequestPhases
from router.serving.slo import SloBounds

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
MAX_FIELD_LABELS = 64  # distinct unknown field names counted by name; the rest as "<other>"
# the histograms a worker's status carries (WorkerStatus.histograms), exported as
# vllm:<key>_seconds: vLLM's names, measured where vLLM measures them, in the engine
ENGINE_HISTOGRAMS = {
    "request_queue_time": "Time a request waited in the engine's queue (arrival at the "
    "engine to its first admission).",
    "request_prefill_time": "Time from a request's admission to its first token.",
    "request_decode_time": "Time from a request's first token to its last.",
    "request_inference_time": "Time from a request's admission to its last token.",
    "kv_block_lifetime": "Sampled KV blocks: time from caching to eviction.",
    "kv_block_idle_before_evict": "Sampled KV blocks: time unused before eviction.",
    "kv_block_reuse_gap": "Sampled KV blocks: time between two uses (caching, prefix hits).",
}


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
        preempted = CounterMetricFamily(
            "vllm:num_preemptions", "Requests the worker preempted.", labels=labels
        )
        by_mode = CounterMetricFamily(
            "kvc_worker_preemptions",
            "Preemptions by mode: swap kept the victim's KV (host tier), recompute dropped it.",
            labels=[*labels, "mode"],
        )
        for s in self.statuses:
            v = [self.model, s.worker_id]
            preempted.add_metric(v, float(s.swap_preemptions + s.recompute_preemptions))
            by_mode.add_metric([*v, "swap"], float(s.swap_preemptions))
            by_mode.add_metric([*v, "recompute"], float(s.recompute_preemptions))
        yield preempted
        yield by_mode
        yield from self._spec_decode()
        yield from self._tiers()
        yield from self._engine_measured()

    def _engine_measured(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        """What the engines measured: waiting requests by reason, and vLLM's histograms."""
        labels = ["model_name", "worker"]
        waiting = GaugeMetricFamily(
            "kvc_worker_requests_waiting_by_reason",
            "Waiting requests by why the engine's last admission pass left them waiting "
            f"({', '.join(WAIT_REASONS)}: kvstore/requests/protocol.py).",
            labels=[*labels, "reason"],
        )
        hists = {
            key: HistogramMetricFamily(f"vllm:{key}_seconds", help_, labels=labels)
            for key, help_ in ENGINE_HISTOGRAMS.items()
        }
        for s in self.statuses:
            by_reason = s.waiting_by_reason
            for reason in (*WAIT_REASONS, *(r for r in by_reason if r not in WAIT_REASONS)):
                waiting.add_metric(
                    [self.model, s.worker_id, reason], float(by_reason.get(reason, 0))
                )
            for key, h in s.histograms.items():
                fam = hists.get(key)  # (a newer worker's histogram: not known here)
                if fam is not None:
                    fam.add_metric([self.model, s.worker_id], cumulative(h.bounds, h.counts), h.sum)
        yield waiting
        yield from hists.values()

    def _spec_decode(self) -> Iterator[CounterMetricFamily]:
        """Each worker's speculative decoding counters, in vLLM's names."""
        labels = ["model_name", "worker"]
        fams = {
            name: CounterMetricFamily(f"vllm:{name}", help_, labels=labels)
            for name, help_ in (
                ("spec_decode_num_drafts", "Sequences that verified draft tokens in a step."),
                ("spec_decode_num_draft_tokens", "Draft tokens verified."),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
            )
        }
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position (0 = the first draft token).",
            labels=[*labels, "position"],
        )
        for s in self.statuses:
            v = [self.model, s.worker_id]
            for name, fam in fams.items():
                fam.add_metric(v, float(getattr(s, name)))
            for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*v, str(pos)], float(n))
        yield from fams.values()
        yield per_pos

    def _tiers(self) -> Iterator[GaugeMetricFamily]:
        """Each worker's KV tiers below the device, labelled by the tier's value."""
        labels = ["model_name", "worker", "tier"]
        fams = {
            name: GaugeMetricFamily(f"kvc_worker_tier_{name}", help_, labels=labels)
            for name, help_ in (
                ("total_blocks", "KV blocks of the worker's tier."),
                ("cached_blocks", "KV blocks the worker's tier holds now."),
                ("hit_tokens", "Prompt tokens the worker loaded back from the tier since start."),
            )
        }
        for s in self.statuses:
            for tier, figures in s.tiers.items():
                for name, fam in fams.items():
                    value = getattr(figures, name)
                    fam.add_metric([self.model, s.worker_id, str(tier)], float(value))
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


class _Cache(Collector):
    """The router's cache funnel, cached tokens by source tier, and per worker its
    predicted vs realised hits, resyncs and pulls, read at scrape time."""

    def __init__(self) -> None:
        self.funnel: CacheFunnel | None = None
        self.predictions: PredictionTracker | None = None
        self.phases: RequestPhases | None = None

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        if self.phases is not None:
            by_phase = GaugeMetricFamily(
                "kvc_router_requests",
                "The router's requests by phase: routing, submitting (awaiting the worker's "
                "admission), first_token (in the worker's queue or prefill), streaming.",
                labels=["phase"],
            )
            for phase, n in self.phases.counts.items():
                by_phase.add_metric([phase], float(n))
            yield by_phase
        f = self.funnel
        if f is not None:
            stages = CounterMetricFamily(
                "kvc_cache_funnel_tokens",
                "Prompt tokens of the requests placed, by funnel stage: prompt, held (by the "
                "index's best holder), best (best candidate), chosen (expected on the chosen "
                "worker), realised (served from cache).",
                labels=["stage"],
            )
            for stage in STAGES:
                stages.add_metric([stage], float(f.tokens[stage]))
            yield stages
            yield CounterMetricFamily(
                "kvc_cache_funnel_requests",
                "Requests counted in the cache funnel (at their first output).",
                value=float(f.requests),
            )
            tiers = CounterMetricFamily(
                "kvc_prompt_tokens_cached",
                "Prompt tokens served from cache, by the tier they came from (peer: pulled "
                "from another worker).",
                labels=["tier"],
            )
            for tier, n in f.cached_by_tier.items():
                tiers.add_metric([tier.value], float(n))
            yield tiers
        p = self.predictions
        if p is None:
            return
        fams = {
            name: CounterMetricFamily(name, help_, labels=["worker"]) for name, help_ in _PER_WORKER
        }
        for w, wp in list(p.workers.items()):
            for name, value in (
                ("kvc_cache_predicted_tokens", wp.predicted_tokens),
                ("kvc_cache_realised_tokens", wp.realised_tokens),
                ("kvc_cache_prediction_misses", wp.misses),
                ("kvc_index_resyncs", wp.resyncs),
                ("kvc_pulls", wp.pulls),
                ("kvc_pulled_tokens", wp.pulled_tokens),
                ("kvc_pull_misses", wp.pull_misses),
                ("kvc_pull_slow", wp.pull_slow),
            ):
                fams[name].add_metric([w], float(value))
        yield from fams.values()


_PER_WORKER = (
    ("kvc_cache_predicted_tokens", "Cached prompt tokens the router predicted on the worker."),
    ("kvc_cache_realised_tokens", "Cached prompt tokens the worker realised."),
    (
        "kvc_cache_prediction_misses",
        "Placements whose predicted and realised cached tokens differed by a block or more.",
    ),
    ("kvc_index_resyncs", "Resyncs of the worker's index entries the router asked for."),
    ("kvc_pulls", "Placements that carried a pull of cached KV from a peer."),
    ("kvc_pulled_tokens", "Prompt tokens those pulls imported."),
    ("kvc_pull_misses", "Pulls that imported less than planned (the rest recomputed)."),
    ("kvc_pull_slow", "Pulls slower than their priced time by the slow factor."),
)


class _SloCounts(Collector):
    """Requests within the time-to-first-token bound and tokens within the inter-token
    bound, counted on the event loop (plain ints: one thread)."""

    __slots__ = ("bounds", "ttft_met", "ttft_total", "itl_met", "itl_total")

    def __init__(self, bounds: SloBounds) -> None:
        self.bounds = bounds
        self.ttft_met = self.ttft_total = self.itl_met = self.itl_total = 0

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        met = CounterMetricFamily(
            "kvc_slo_met",
            "Requests (ttft) or output tokens (itl) within their bound.",
            labels=["slo"],
        )
        total = CounterMetricFamily(
            "kvc_slo_observed", "Requests (ttft) or output tokens (itl) measured.", labels=["slo"]
        )
        bound = GaugeMetricFamily(
            "kvc_slo_bound_seconds", "The objective's bound (router.slo).", labels=["slo"]
        )
        for slo, m, t, b in (
            ("ttft", self.ttft_met, self.ttft_total, self.bounds.ttft_s),
            ("itl", self.itl_met, self.itl_total, self.bounds.itl_s),
        ):
            met.add_metric([slo], float(m))
            total.add_metric([slo], float(t))
            bound.add_metric([slo], b)
        yield from (met, total, bound)


class ServingMetrics:
    """What one router served; :meth:`render` is the ``/metrics`` body."""

    def __init__(
        self,
        model: str,
        *,
        slo: SloBounds | None = None,
        log_stats: bool = True,
    ) -> None:
        """``log_stats`` off: requests are not timed or counted (:meth:`tracker`)."""
        self.model = model
        self.log_stats = log_stats
        self.registry = CollectorRegistry(auto_describe=False)
        r, by_worker = self.registry, ("model_name", "worker")
        self._statuses = _Statuses(model)
        r.register(self._statuses)
        self._routing = _Routing()
        r.register(self._routing)
        self._cache = _Cache()
        r.register(self._cache)
        self.slo = _SloCounts(slo or SloBounds())
        r.register(self.slo)
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

    def read_core(
        self,
        funnel: CacheFunnel,
        predictions: PredictionTracker | None,
        phases: RequestPhases | None = None,
    ) -> None:
        """Export the serving core's cache funnel, predicted-vs-realised table and requests
        by phase (read at scrape time)."""
        self._cache.funnel, self._cache.predictions = funnel, predictions
        self._cache.phases = phases

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

    def tracker(self) -> RequestTimer | Untimed:
        return RequestTimer(self) if self.log_stats else UNTIMED

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


class Untimed:
    """A request's outputs not measured (``log_stats`` off)."""

    __slots__ = ()

    def output(self, worker: str, out: RequestOutput) -> None:
        pass


UNTIMED = Untimed()


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
            slo = self.m.slo
            if self.tokens == 0:
                ttft = now - self.start
                s.ttft.observe(ttft)
                slo.ttft_total += 1
                slo.ttft_met += ttft <= slo.bounds.ttft_s
                k_gaps, gap_from = k - 1, now
            else:
                k_gaps, gap_from = k, self.last
            if k_gaps:
                gap = (now - gap_from) / k_gaps
                s.itl.observe(gap, k_gaps)
                slo.itl_total += k_gaps
                if gap <= slo.bounds.itl_s:
                    slo.itl_met += k_gaps
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
