"""Worker telemetry against a recording stand-in for ``ray.util.metrics``: the gauges are set
again by the heartbeat while no step runs (Ray drops a gauge nobody set for ~30 s), and
preemptions are a counter increased by exactly the engine's preemptions."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.engine.fakes import FakeExecutor
from tests.engine.test_scheduler import prompts
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.telemetry import WorkerTelemetry


class _Metric:
    def __init__(self, name: str, description: str = "", **kwargs: object) -> None:
        self.name = name
        self.kind = type(self).__name__
        self.sets: list[float] = []  # Gauge.set values
        self.incs: list[float] = []  # Counter.inc values
        self.observed: list[float] = []  # Histogram.observe values

    def set(self, value: float, tags: dict) -> None:
        self.sets.append(value)

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.incs.append(value)

    def observe(self, value: float, tags: dict) -> None:
        self.observed.append(value)


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
    assert tel.ttft.observed and tel.itl.observed

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
