"""Engine metrics: counters, latency samples, and the snapshot the worker reports from."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstore.blocks.tiers import Tier
from kvstore.requests.histograms import Histogram, HistogramCounts
from kvstore.requests.protocol import TierFigures
from kvstore.runtime.stats import quantile
from worker.kv.types import TierStats

_SAMPLES = 100_000  # latency samples kept (most recent)
# seconds, for queue, prefill, decode and inference times: a queue wait of a few ms to
# requests running for minutes
PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS_S += (20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Percentiles of a latency sample, in seconds (0.0 when empty)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> LatencySummary:
        data = sorted(values)
        if not data:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = (quantile(data, q) for q in (0.5, 0.9, 0.99))
        return cls(len(data), sum(data) / len(data), p50, p90, p99)


STEP_STAGES = ("schedule", "prepare", "forward", "sample", "process", "output", "kv_events")


@dataclass(frozen=True, slots=True)
class StageSeconds:
    """Where the engine thread's time went, summed over all steps so far (seconds).

    ``schedule``: the scheduler's pick and KV allocation; ``prepare``: the model input built
    from the chunks (the executor's share of ``execute`` before the model runs);
    ``forward``: the model (and KV copies / tier transfers); ``sample``: logits -> token ids
    on the host; ``process``: stop rules, detokenization, the scheduler applying the tokens,
    finished requests reaped; ``output``: the step's ``RequestOutput`` objects;
    ``kv_events``: draining the KV manager's events (``drain_kv_events``, outside the step).
    On a GPU the model runs asynchronously, so its time shows where the host first waits for
    it: in ``sample`` (the one synchronisation of a step)."""

    steps: int = 0  # steps timed (those that ran the model)
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    process: float = 0.0
    output: float = 0.0
    kv_events: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in STEP_STAGES)

    @property
    def host(self) -> float:
        """Everything but the model: the engine's own per-step host work."""
        return self.total - self.forward

    def minus(self, earlier: StageSeconds) -> StageSeconds:
        """The time spent between ``earlier`` and this snapshot."""
        fields = {name: getattr(self, name) - getattr(earlier, name) for name in STEP_STAGES}
        return StageSeconds(steps=self.steps - earlier.steps, **fields)

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each stage (and ``total``, ``host``)."""
        n = max(self.steps, 1)
        out = {name: getattr(self, name) * 1e3 / n for name in STEP_STAGES}
        out["total"], out["host"] = self.total * 1e3 / n, self.host * 1e3 / n
        return out


class StageTimer:
    """Running sums of :class:`StageSeconds`, added to by the engine thread (plain floats:
    no allocation per step)."""

    __slots__ = ("steps", *STEP_STAGES)

    def __init__(self) -> None:
        self.steps = 0
        for name in STEP_STAGES:
            setattr(self, name, 0.0)

    def snapshot(self) -> StageSeconds:
        return StageSeconds(self.steps, *(getattr(self, name) for name in STEP_STAGES))


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine's state between two steps, taken at once (``Engine.snapshot``): what the
    worker derives its load report, its status answer and its gauges from. A field that
    :class:`~kvstore.index_types.WorkerLoad` or :class:`~kvstore.requests.protocol.WorkerStatus`
    also has carries the same name, so they are derived by name (``worker/status.py``)."""

    running: int  # requests holding or acquiring KV blocks
    waiting: int  # requests queued (new or preempted)
    queued_prefill_tokens: int  # prompt tokens still to compute: waiting + unfinished prefills
    # (a waiting prompt less its cached or already-queued prefix) - the router's "work queued here"
    decode_tokens: int  # running sequences with one token to compute (decodes of the next step)
    kv_usage: float  # used blocks / all blocks
    kv_used_blocks: int  # blocks with a reference
    free_blocks: int  # KV blocks allocatable now: free plus evictable cached ones
    total_blocks: int  # KV pool size
    prefix_hit_rate: float  # prompt tokens served from the prefix cache / prompt tokens admitted
    tenant_quota_evictions: int  # idle cached blocks evicted over their tenant's cache quota
    num_preemptions: int  # requests preempted so far (swap or recompute)
    num_partial_prefills: int  # prefill chunks that stopped short of their prompt (chunking)
    num_steps: int  # engine steps that ran the model
    computed_tokens: int  # tokens run through the model (prefill + decode)
    prompt_tokens: int  # prompt tokens of finished requests
    generation_tokens: int  # tokens sampled
    num_finished: int  # requests finished (any reason)
    num_swap_preemptions: int = 0  # of num_preemptions, those that kept the KV (swap)
    recomputed_tokens: int = 0  # tokens resumed requests computed again (found in no tier)
    # of free_blocks, the evictable cached ones the waiting requests' prefixes will pin when
    # they start (each once)
    waiting_pinned_blocks: int = 0
    admits_cached_first: bool = False  # cache-aware admission (EngineConfig)
    lora_ids: tuple[str, ...] = ()  # stable ids of the registered LoRA adapters, sorted
    lora_loaded: tuple[str, ...] = ()  # of those, the ones in a device slot now, sorted
    lora_owners: tuple[str, ...] = ()  # "adapter_id=tenant" of the owned ones, sorted
    stage_seconds: StageSeconds = StageSeconds()  # engine-thread time per step stage, summed
    # speculative decoding (vLLM's names): sequences that verified drafts, draft tokens
    # verified, of those accepted, and accepted per draft position (0 = first draft token)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache (any tier)
    # every lower KV tier's figures, fastest first (host, disk): blocks, bytes, hits, reads,
    # writes, skipped reads, evictions (worker.kv.TierStats)
    kv_tiers: tuple[TierStats, ...] = ()
    # vLLM's histograms by name less "vllm:" and "_seconds": the finished requests' phase
    # times (request_queue_time, _prefill_, _decode_, _inference_; EngineConfig.log_stats)
    # and the sampled blocks' residency (kv_block_lifetime, _idle_before_evict, _reuse_gap)
    histograms: dict[str, HistogramCounts] = field(default_factory=dict)
    # the waiting requests by why the last admission pass left them waiting, and "new" for
    # those that arrived since (Scheduler.waiting_by_reason)
    waiting_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def tiers(self) -> dict[Tier, TierFigures]:
        """Its KV tiers below the device as a status reports them (a tier not named: none)."""
        return {
            t.tier: TierFigures(
                t.num_blocks, t.cached_blocks, t.hit_tokens, t.loaded_blocks, t.stored_blocks
            )
            for t in self.kv_tiers
        }

    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Prompt tokens served from the prefix cache by the tier they came from
        (``device`` and each lower tier's name), summing to ``prefix_hit_tokens``."""
        lower = {s.tier.value: s.hit_tokens for s in self.kv_tiers}
        return {"device": self.prefix_hit_tokens - sum(lower.values()), **lower}


_EMPTY = LatencySummary(0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class EngineMetrics(EngineSnapshot):
    """A snapshot plus latency percentiles (sorting the samples is too slow for every step)."""

    ttft: LatencySummary = _EMPTY  # arrival -> first token
    itl: LatencySummary = _EMPTY  # between consecutive tokens of a request


class RequestTimes:
    """vLLM's per-request phase histograms, observed once per finished request that was
    admitted: queue (arrival at the engine to first admission), prefill (admission to first
    token), decode (first token to last) and inference (admission to last token)."""

    __slots__ = ("queue", "prefill", "decode", "inference", "_counts")

    def __init__(self) -> None:
        self.queue = Histogram(PHASE_BUCKETS_S)
        self.prefill = Histogram(PHASE_BUCKETS_S)
        self.decode = Histogram(PHASE_BUCKETS_S)
        self.inference = Histogram(PHASE_BUCKETS_S)
        self._counts: dict[str, HistogramCounts] | None = None  # until the next observation

    def finished(self, arrived: float, admitted: float, first: float | None, end: float) -> None:
        """``first``: the first token's time (None: none came); ``end``: the last token's
        time, or when it ended without one."""
        self._counts = None
        self.queue.observe(admitted - arrived)
        self.inference.observe(end - admitted)
        if first is not None:
            self.prefill.observe(first - admitted)
            self.decode.observe(end - first)

    def histograms(self) -> dict[str, HistogramCounts]:
        """By vLLM's name less ``vllm:`` and ``_seconds`` (one dict while nothing changes:
        the snapshot after every step asks; callers never mutate it)."""
        if self._counts is None:
            self._counts = {
                "request_queue_time": self.queue.counts_now(),
                "request_prefill_time": self.prefill.counts_now(),
                "request_decode_time": self.decode.counts_now(),
                "request_inference_time": self.inference.counts_now(),
            }
        return self._counts


class MetricsRecorder:
    """Accumulates what the snapshot reports; mutated only by the engine thread.
    ``log_stats`` off: the phase histograms are not observed."""

    def __init__(self, log_stats: bool = True) -> None:
        self.log_stats = log_stats
        self.phases = RequestTimes()
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.recomputed_tokens = 0
        self.num_partial_prefills = 0
        self.num_steps = 0
        self.computed_tokens = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_finished = 0
        self.ttft: deque[float] = deque(maxlen=_SAMPLES)
        self.itl: deque[float] = deque(maxlen=_SAMPLES)
        self.stages = StageTimer()
