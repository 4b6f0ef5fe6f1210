"""Worker telemetry against a recording stand-in for ``ray.util.metrics``: the gauges are set
again by the heartbeat while no step runs (Ray drops a gauge nobody set for ~30 s), and
preemptions are a counter increased by exactly the engine's preemptions; latencies are
observed off the engine thread, in bulk, with exactly the values per-token recording gives."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from types import SimpleNamespace

from tests.engine.fakes import FakeExecutor
from tests.engine.test_scheduler import prompts
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.telemetry import LATENCY_BUCKETS_S, WorkerTelemetry


class _Metric:
    def __init__(self, name: str, description: str = "", **kwargs: object) -> None:
        self.name = name
        self.kind = type(self).__name__
        self.sets: list[float] = []  # Gauge.set values
        self.incs: list[float] = []  # Counter.inc values
        self.observed: list[float] = []  # Histogram.observe values
        self.threads: set[str] = set()  # threads that observed

    def set(self, value: float, tags: dict) -> None:
        self.sets.append(value)

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.incs.append(value)

    def observe(self, value: float, tags: dict) -> None:
        self.observed.append(value)
        self.threads.add(threading.current_thread().name)


class Gauge(_Metric): ...


class Counter(_Metric): ...


class Histogram(_Metric): ...


FAKE_METRICS = SimpleNamespace(Gauge=Gauge, Counter=Counter, Histogram=Histogram)


def test_gauges_refresh_without_steps_and_preemptions_count() -> None:
    ex = FakeExecutor(24, 4)
    engine = Engine(
        ex,
        EngineConfig(
            block_size=4,
            num_blocks=24,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=256,
        ),
    )
    tel = WorkerTelemetry("worker-0", metrics_api=FAKE_METRICS)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for p in prompts(8, 6, 30, seed=1):
        tel.arrived(engine.add_request(p, params))
    while engine.has_unfinished_requests():
        outs = engine.step()
        tel.after_step(engine.snapshot(), outs)
    preempted = engine.metrics().num_preemptions
    assert preempted > 0
    assert isinstance(tel.preemptions, Counter)
    assert sum(tel.preemptions.incs) == preempted  # a counter, by deltas
    assert not tel.ttft.observed and not tel.itl.observed  # queued, not observed in the step
    assert tel.flush() == tel.ttft_count + tel.itl_count > 0
    assert len(tel.ttft.observed) == tel.ttft_count and len(tel.itl.observed) == tel.itl_count

    gauges = (tel.kv_usage, tel.running, tel.waiting, tel.hit_rate, tel.quota_evictions)
    after_steps = [len(g.sets) for g in gauges]
    tel.start_heartbeat(interval_s=0.01)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(tel.running.sets) < after_steps[1] + 3:
            time.sleep(0.01)
    finally:
        tel.stop_heartbeat()
    # no step ran, yet every gauge was set again, to the engine's final state
    for g, n in zip(gauges, after_steps, strict=True):
        assert len(g.sets) >= n + 3, g.name
    assert tel.running.sets[-1] == 0 and tel.waiting.sets[-1] == 0
    assert tel.kv_usage.sets[-1] == engine.kv.stats().usage
    assert tel.hit_rate.sets[-1] == engine.kv.stats().prefix_hit_rate
    assert sum(tel.preemptions.incs) == preempted  # the heartbeat adds nothing


def _buckets(values: list[float]) -> list[int]:
    """Prometheus' cumulative bucket counts (``le``) of ``values``, +Inf last."""
    counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
    for v in values:
        counts[bisect.bisect_left(LATENCY_BUCKETS_S, v)] += 1
    return [sum(counts[: i + 1]) for i in range(len(counts))]


def test_bulk_flushed_latencies_equal_per_token_recording() -> None:
    """A clock that moves by a known amount per step: the values the heartbeat observes
    are exactly each request's arrival -> first token and token -> token times, read off the
    outputs independently, so the histograms' buckets, counts and sums are the same as when
    every token was observed in its step; the engine thread observes nothing."""
    ex = FakeExecutor(64, 4)
    engine = Engine(
        ex,
        EngineConfig(
            block_size=4,
            num_blocks=64,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            max_model_len=256,
        ),
    )
    now = [100.0]
    tel = WorkerTelemetry("worker-0", metrics_api=FAKE_METRICS, clock=lambda: now[0])  # type: ignore[arg-type]
    arrival: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    for i, p in enumerate(prompts(12, 5, 40, seed=3)):
        now[0] += 0.003 * i  # staggered arrivals
        rid = engine.add_request(p, params)
        tel.arrived(rid)
        arrival[rid] = now[0]
    tel.start_heartbeat(interval_s=60, flush_s=0.01)
    step = 0
    try:
        while engine.has_unfinished_requests():
            step += 1
            now[0] += (0.004, 0.07, 0.3)[step % 3]  # ITLs in several buckets
            outs = engine.step()
            for out in outs:
                if any(d.token_ids for d in out.outputs):
                    token_times.setdefault(out.request_id, []).append(now[0])
            tel.after_step(engine.snapshot(), outs)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            len(tel.ttft.observed) < tel.ttft_count or len(tel.itl.observed) < tel.itl_count
        ):
            time.sleep(0.01)
    finally:
        tel.stop_heartbeat()
    ttft = [times[0] - arrival[rid] for rid, times in token_times.items()]
    itl = [b - a for times in token_times.values() for a, b in itertools.pairwise(times)]
    assert len(ttft) == 12 and len(itl) == 12 * 8
    assert sorted(tel.ttft.observed) == sorted(ttft)
    assert sorted(tel.itl.observed) == sorted(itl)
    for hist, values in ((tel.ttft, ttft), (tel.itl, itl)):
        assert _buckets(hist.observed) == _buckets(values)
        assert sum(sorted(hist.observed)) == sum(sorted(values))
        assert hist.threads == {"kvc-gauges"}  # the heartbeat's thread, not this one
    assert len(set(_buckets(itl))) == 3  # the values spread over buckets


def test_log_stats_off_measures_no_latency_but_sets_gauges() -> None:
    engine = Engine(FakeExecutor(64, 4), EngineConfig(block_size=4, max_model_len=64))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for on in (True, False):
        tel = WorkerTelemetry("w", metrics_api=FAKE_METRICS, log_stats=on)  # type: ignore[arg-type]
        rid = engine.add_request([5, 6, 7], params)
        tel.arrived(rid)
        while engine.has_unfinished_requests():
            tel.after_step(engine.snapshot(), engine.step())
        tel.flush()
        assert (tel.ttft_count, tel.itl_count) == ((1, 2) if on else (0, 0))
        assert tel.gauge_refreshes > 0 and tel.running.sets
