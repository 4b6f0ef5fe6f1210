"""``Engine.snapshot``: one frozen record of the engine between steps, and the worker's load
report, status answer and gauges all derived from it (they can never disagree)."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.index_types import WorkerLoad
from kvstore.requests.protocol import WorkerStatus
from tests.engine.fakes import FakeExecutor
from tests.engine.test_scheduler import prompts
from tests.worker.test_telemetry import FAKE_METRICS
from worker.engine import Engine, EngineConfig, EngineSnapshot, SamplingParams
from worker.engine.metrics import STEP_STAGES
from worker.status import worker_load, worker_status
from worker.telemetry import WorkerTelemetry

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make(num_blocks: int, **cfg: int) -> Engine:
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_model_len=256, **cfg)
    return Engine(FakeExecutor(num_blocks, 4), config)


def from_internals(engine: Engine) -> dict[str, object]:
    """What the snapshot should say, read from the scheduler, sequences and pool directly."""
    sched, kv = engine.scheduler, engine.kv.stats()
    running = [s for r in sched.running for s in r.seqs]
    waiting = sum(len(s.token_ids) - s.cached_hint for r in sched.waiting for s in r.seqs)
    prefilling = sum(s.num_remaining for s in running if s.num_remaining > 1)
    return {
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "queued_prefill_tokens": waiting + prefilling,
        "decode_tokens": sum(1 for s in running if s.num_remaining <= 1),
        "kv_used_blocks": kv.used_blocks,
        "free_blocks": engine.kv.num_free_blocks(),
        "total_blocks": engine.kv.num_blocks,
        "kv_usage": kv.used_blocks / engine.kv.num_blocks,
        "prefix_hit_rate": kv.prefix_hit_rate,
        "num_preemptions": engine.stats.num_preemptions,
        "num_finished": engine.stats.num_finished,
        "generation_tokens": engine.stats.generation_tokens,
    }


def assert_derived_agree(snap: EngineSnapshot, tel: WorkerTelemetry) -> None:
    load = worker_load(snap)
    status = worker_status("w-0", snap, epoch=3, index_healthy=True)
    g = tel.gauges
    assert load.running == status.running == g.running == snap.running
    assert load.waiting == status.waiting == g.waiting == snap.waiting
    assert load.free_blocks == status.free_blocks == snap.free_blocks
    assert load.total_blocks == status.total_blocks == snap.total_blocks
    assert load.queued_prefill_tokens == status.queued_prefill_tokens
    assert load.queued_prefill_tokens == snap.queued_prefill_tokens
    assert load.decode_tokens == snap.decode_tokens
    sizes = {t: f.total_blocks for t, f in snap.tiers.items()}
    assert load.tier_blocks == sizes and status.tiers == snap.tiers
    assert status.prefix_hit_rate == g.prefix_hit_rate == snap.prefix_hit_rate
    assert g.kv_usage == snap.kv_usage
    assert status.recompute_preemptions + status.swap_preemptions == snap.num_preemptions
    assert sum(tel.preemptions.incs) == snap.num_preemptions
    assert (status.worker_id, status.epoch, status.index_healthy) == ("w-0", 3, True)


def test_snapshot_figures_through_admission_chunked_prefill_and_decode() -> None:
    engine = make(12, max_num_batched_tokens=8, max_num_seqs=4)
    a = engine.add_request(list(range(2, 12)), GREEDY)  # 10 tokens: two chunks
    engine.add_request(list(range(20, 26)), GREEDY)  # 6 tokens: waits behind a's first chunk
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.queued_prefill_tokens) == (0, 2, 16)
    assert (snap.kv_used_blocks, snap.free_blocks, snap.decode_tokens) == (0, 12, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.running = 5  # type: ignore[misc]

    engine.step()  # a's first chunk (8 of 10 tokens) takes the whole budget
    snap = engine.snapshot()
    assert (snap.running, snap.waiting) == (1, 1)
    assert snap.queued_prefill_tokens == (10 - 8) + 6
    assert (snap.kv_used_blocks, snap.free_blocks, snap.decode_tokens) == (2, 10, 0)
    assert snap.num_partial_prefills == 1 and snap.computed_tokens == 8

    engine.step()  # a's last 2 tokens (first token sampled) and b's whole prompt
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.queued_prefill_tokens) == (2, 0, 0)
    assert snap.decode_tokens == 2 and snap.generation_tokens == 2
    assert snap.kv_used_blocks == 3 + 2 and snap.computed_tokens == 16

    while engine.has_unfinished_requests():
        finished = {o.request_id for o in engine.step() if o.finished}
        assert engine.snapshot() == engine.snapshot()  # a pure read
        if a in finished:
            break
    snap = engine.snapshot()
    assert snap.num_finished >= 1 and snap.prompt_tokens >= 10
    fields = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
    assert snap == EngineSnapshot(**{**fields, **from_internals(engine)})


def test_snapshot_matches_the_engine_and_load_status_gauges_agree_through_preemption() -> None:
    engine = make(24, max_num_seqs=4, max_num_batched_tokens=16)
    tel = WorkerTelemetry("w-0", metrics_api=FAKE_METRICS)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for p in prompts(8, 6, 30, seed=1):
        engine.add_request(p, params)
    seen = {"waiting": False, "prefill": False, "decode": False, "preempted": False}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        snap = engine.snapshot()
        for name, want in from_internals(engine).items():
            assert getattr(snap, name) == want, name
        tel.after_step(snap, outputs)
        assert_derived_agree(snap, tel)
        seen["waiting"] |= snap.waiting > 0
        seen["prefill"] |= snap.queued_prefill_tokens > 0 and snap.running > 0
        seen["decode"] |= snap.decode_tokens > 0
        seen["preempted"] |= snap.num_preemptions > 0
    assert all(seen.values()), seen
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.kv_used_blocks) == (0, 0, 0)
    assert snap.num_finished == 8 and snap.generation_tokens == 8 * 20
    m = engine.metrics()  # the snapshot plus latencies
    assert EngineSnapshot(**{f.name: getattr(m, f.name) for f in dataclasses.fields(snap)}) == snap
    assert m.ttft.count == 8


def test_stage_seconds_sum_the_steps_that_ran_the_model() -> None:
    """Every model step is timed once; each stage's time is its own (they add up to at most
    the wall time of the steps); a later snapshot minus an earlier one is the time between."""
    import time

    engine = make(64, max_num_batched_tokens=16, max_num_seqs=4)
    for p in prompts(3, 5, 9, seed=1):
        engine.add_request(p, SamplingParams(max_tokens=5))
    first = engine.snapshot().stage_seconds
    assert first.steps == 0 and first.total == 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        engine.drain_kv_events()
    wall = time.perf_counter() - start
    snap = engine.snapshot()
    stages = snap.stage_seconds
    assert stages.steps == snap.num_steps > 0
    assert stages.forward > 0 and stages.schedule > 0 and stages.sample > 0
    assert all(getattr(stages, name) >= 0 for name in STEP_STAGES)
    assert stages.total <= wall
    assert stages.host == pytest.approx(stages.total - stages.forward)
    between = stages.minus(first)
    assert between == stages  # nothing before the first snapshot
    per_step = stages.per_step_ms()
    assert per_step["total"] == pytest.approx(stages.total * 1e3 / stages.steps)
    assert set(per_step) == {*STEP_STAGES, "total", "host"}


def test_load_and_status_fields_are_named_as_the_snapshots() -> None:
    """The load and the status are derived by field name: each of their fields is a
    snapshot's (or the load's) of the same name, or one of the few given explicitly, so a
    figure renamed on one side fails here instead of silently taking its default."""
    # ``tiers`` is a property of the snapshot, derived from its ``kv_tiers``
    snap = {f.name for f in dataclasses.fields(EngineSnapshot)} | {"tiers"}
    load = {f.name for f in dataclasses.fields(WorkerLoad)}
    status = {f.name for f in dataclasses.fields(WorkerStatus)}
    assert load - snap == {"tier_blocks"}  # the tiers' sizes, from snap.tiers
    given = {"worker_id", "epoch", "index_healthy", "swap_preemptions", "recompute_preemptions"}
    given |= {"model_load_s"}  # the worker's, not the engine's
    by_router = {"stale", "heartbeat_age_s"}
    assert status - snap - load == given | {"adapters"} | by_router
