"""What the engine measures for metrics, under workloads that cause it: each finished
request's queue, prefill, decode and inference times (on a clock the test moves), the
waiting requests by reason, and both carried by the worker's status."""

from __future__ import annotations

import time

import pytest

from tests.engine.fakes import FakeExecutor
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.status import worker_status

TWO = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def make(num_blocks: int = 64, **cfg) -> Engine:
    return Engine(FakeExecutor(num_blocks, 4), EngineConfig(block_size=4, max_model_len=64, **cfg))


def test_phase_times_of_a_queued_request(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    engine = make(max_num_seqs=1)
    engine.add_request([5, 6, 7], TWO)  # both arrive at t=0
    engine.add_request([8, 9, 10], TWO)
    for t in (1.0, 2.0, 3.0, 4.0):  # a runs at t=1 (prefill) and 2, b waits until t=3
        clock[0] = t
        engine.step()
    assert not engine.has_unfinished_requests()
    h = engine.snapshot().histograms
    queue, prefill = h["request_queue_time"], h["request_prefill_time"]
    decode, inference = h["request_decode_time"], h["request_inference_time"]
    assert (queue.count, queue.sum) == (2, 1.0 + 3.0)
    assert (prefill.count, prefill.sum) == (2, 0.0)  # the first token comes in its admission step
    assert (decode.count, decode.sum) == (2, 2.0)
    assert (inference.count, inference.sum) == (2, 2.0)
    assert queue.counts[queue.bounds.index(1.0)] == 1  # a's second in the le=1 bucket


def test_log_stats_off_measures_no_phase_or_block(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make(log_stats=False, kv_block_sample_stride=1)
    engine.add_request([5, 6, 7, 8, 9], TWO)
    while engine.has_unfinished_requests():
        engine.step()
    h = engine.snapshot().histograms
    assert len(h) == 7 and all(c.count == 0 for c in h.values())
    assert all(b.sample is None for b in engine.kv.pool.blocks)


def test_waiting_requests_by_reason() -> None:
    engine = make(max_num_seqs=1)
    for i in range(3):
        engine.add_request([5 + i, 6, 7], TWO)
    assert engine.snapshot().waiting_by_reason == {"new": 3}  # no admission pass yet
    engine.step()
    assert engine.snapshot().waiting_by_reason == {"max_num_seqs": 2}
    engine.add_request([9, 9, 9], TWO)
    snap = engine.snapshot()
    assert snap.waiting_by_reason == {"max_num_seqs": 2, "new": 1}
    status = worker_status("w0", snap, epoch=None, index_healthy=True)
    assert status.waiting_by_reason == {"max_num_seqs": 2, "new": 1}
    assert set(status.histograms) >= {"request_queue_time", "kv_block_reuse_gap"}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.snapshot().waiting_by_reason == {}


def test_a_request_waits_for_kv_blocks_or_the_token_budget() -> None:
    engine = make(num_blocks=6, admission_watermark=0.0)  # 6 blocks of 4 tokens
    engine.add_request(list(range(5, 21)), TWO)  # 16 tokens + 2: 5 blocks
    engine.add_request(list(range(30, 46)), TWO)
    engine.step()
    assert engine.snapshot().waiting_by_reason == {"kv_blocks": 1}
    engine = make(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    engine.add_request([5, 6, 7, 8, 9, 10], TWO)
    engine.add_request([11, 12, 13, 14, 15, 16], TWO)  # 6 more tokens: over the budget of 8
    engine.add_request([17, 18, 19], TWO)
    engine.step()
    assert engine.snapshot().waiting_by_reason == {"budget": 2}
