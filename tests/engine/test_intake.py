"""The streaming front's intake queue: a step in progress never blocks the caller's event
loop, a burst is taken in between two steps, outputs leave once per loop per step."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.blocks.looplag import LoopLagProbe
from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import (
    Engine,
    EngineConfig,
    EngineOverloaded,
    InvalidRequest,
    OutputSink,
    SamplingParams,
    StreamingEngine,
)

PROMPT = [5, 40, 77, 300, 12, 9, 81, 33]
SLOW_STEP_S = 0.2


def slow_front(tiny_dir, **config) -> StreamingEngine:  # noqa: ANN001
    """A front whose every step takes at least SLOW_STEP_S (the engine thread sleeps in it,
    as a long model step on an accelerator would keep it busy)."""
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=256, **config))
    step = engine.step

    def slow() -> list:
        time.sleep(SLOW_STEP_S)
        return step()

    engine.step = slow  # type: ignore[method-assign]
    return StreamingEngine(engine, idle_wait_s=0.01).start()


def test_a_step_in_progress_never_blocks_the_event_loop(tiny_dir) -> None:
    front = slow_front(tiny_dir, max_num_seqs=64, max_waiting=64)
    long = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main() -> tuple[float, int, list]:
        probe = LoopLagProbe(0.002)
        probe.report(reset=True)
        first = await front.add_request_async(PROMPT, long)
        await asyncio.sleep(SLOW_STEP_S / 2)  # the engine thread is inside a step now
        probe.report(reset=True)
        before = front.steps
        streams = await asyncio.gather(
            *(front.add_request_async([7 + i, *PROMPT], long) for i in range(32))
        )
        steps_to_admit = front.steps - before
        snap = await front.with_engine_async(Engine.snapshot)
        assert snap.num_waiting + snap.num_running == 33
        assert front.abort(streams[0].request_id)
        results = await asyncio.gather(first.acollect(), *(s.acollect() for s in streams))
        return probe.report()["max_lag_ms"], steps_to_admit, results

    try:
        lag_ms, steps_to_admit, results = asyncio.run(main())
        assert lag_ms < 50, f"the loop stalled {lag_ms:.1f} ms while steps ran"
        assert steps_to_admit <= 1  # all 32 taken in between two steps
        assert results[1].completions[0].finish_reason == "abort"
        for res in [results[0], *results[2:]]:
            assert len(res.completions[0].token_ids) == 8
        front.with_engine(assert_no_blocks_in_use)
    finally:
        front.stop()


def test_checks_come_back_at_once_and_capacity_from_the_engine_thread(tiny_dir) -> None:
    front = slow_front(tiny_dir, max_waiting=2, max_num_seqs=1)
    try:
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequest) as bad:
            front.add_request([1] * 5000, SamplingParams())
        assert bad.value.field == "prompt"
        assert time.perf_counter() - t0 < SLOW_STEP_S / 2  # checked before the queue
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        streams = [front.add_request(PROMPT, params) for _ in range(2)]
        with pytest.raises(InvalidRequest) as dup:  # found by the engine thread, raised here
            front.add_request(PROMPT, params, request_id=streams[1].request_id)
        assert dup.value.field == "request_id"
        with pytest.raises(EngineOverloaded):  # 2 wait at most (one may run meanwhile)
            for _ in range(4):
                streams.append(front.add_request(PROMPT, params))
        for s in streams:
            assert s.collect().finished
    finally:
        front.stop()


class CountingSink(OutputSink):
    """Shared by many requests; counts deliveries."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls = 0
        self.items: list = []
        self.done = asyncio.Event()
        self.open = 0

    def deliver(self, items: list) -> None:
        self.calls += 1
        self.items.extend(items)
        self.open -= sum(1 for i in items if i.finished)
        if self.open == 0:
            self.done.set()


def test_a_shared_sink_gets_one_delivery_per_step_for_all_its_requests(tiny_dir) -> None:
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=256))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = [r.completions[0].token_ids for r in engine.generate([PROMPT] * 1, params)]

    async def main() -> CountingSink:
        sink = CountingSink(asyncio.get_running_loop())
        sink.open = 10
        with StreamingEngine(engine) as front:
            await asyncio.gather(
                *(
                    front.add_request_async(PROMPT, params, request_id=f"r{i}", sink=sink)
                    for i in range(10)
                )
            )
            await asyncio.wait_for(sink.done.wait(), 60)
            front.with_engine(assert_no_blocks_in_use)
            return sink, front.steps

    sink, steps = asyncio.run(main())
    by_request: dict[str, list[int]] = {}
    for out in sink.items:
        by_request.setdefault(out.request_id, []).extend(
            t for d in out.outputs for t in d.token_ids
        )
    assert by_request == {f"r{i}": reference[0] for i in range(10)}
    # taken in together: 6 steps of 10 outputs, one delivery each (not one per request)
    assert sink.calls <= steps <= 7
    assert len(sink.items) >= 6 * 10
