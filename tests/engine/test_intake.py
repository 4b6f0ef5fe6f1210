"""The streaming front's intake queue: a step in progress never blocks the caller's event
loop, a burst is taken in between two steps, outputs leave once per loop per step."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from tests.engine.helpers import HeldSteps, LoopTurns, assert_no_blocks_in_use
from worker.engine import (
    Engine,
    EngineConfig,
    EngineLoop,
    EngineOverloaded,
    InvalidRequest,
    OutputSink,
    SamplingParams,
)
from worker.engine.commands import Snapshot

PROMPT = [5, 40, 77, 300, 12, 9, 81, 33]
SLOW_STEP_S = 0.2
PROBES = 20  # answers of the loop's probe while one step is in progress


def slow_front(tiny_dir, **config) -> EngineLoop:  # noqa: ANN001
    """A front whose every step takes at least SLOW_STEP_S (the engine thread sleeps in it,
    as a long model step on an accelerator would keep it busy)."""
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=256, **config))
    step = engine.step

    def slow() -> list:
        time.sleep(SLOW_STEP_S)
        return step()

    engine.step = slow  # type: ignore[method-assign]
    return EngineLoop(engine, idle_wait_s=0.01).start()


def test_a_step_in_progress_never_blocks_the_event_loop(tiny_dir) -> None:
    """While a step is in progress (held as long as the test needs, not timed), 32 requests
    are queued, a probe on the loop keeps answering, and the test's own loop releases the
    step: nothing the loop did waited for it. All 32 are taken in between two steps."""
    config = EngineConfig(num_blocks=256, max_num_seqs=64, max_waiting=64)
    engine = Engine.from_model_dir(tiny_dir, config)
    held = HeldSteps(engine)
    front = EngineLoop(engine, idle_wait_s=0.01).start()
    long = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main() -> tuple[list[float], int, list]:
        probe = LoopTurns(0.002)
        held.hold()
        first = await front.add_request_async(PROMPT, long)
        assert await held.in_step(1)  # the engine thread is inside a step, and stays there
        probe.start()
        adds = asyncio.gather(*(front.add_request_async([7 + i, *PROMPT], long) for i in range(32)))
        lags = await probe.answered(PROBES)  # the loop turns while the step runs
        # the step still runs (the test's loop lets it go) and the adds wait for the engine
        # thread, not the loop
        released = held.release() and not adds.done()
        assert released, "the step ended on its own: the loop waited for it"
        assert await held.in_step(2)  # what was queued is taken in before the next step
        streams = await asyncio.wait_for(adds, 30)
        steps_to_admit = front.steps
        held.free()
        probe.stop()
        snap = await front.call_async(Snapshot())
        assert snap.num_waiting + snap.num_running == 33
        assert front.abort(streams[0].request_id)
        results = await asyncio.gather(first.acollect(), *(s.acollect() for s in streams))
        return lags, steps_to_admit, results

    try:
        lags, steps_to_admit, results = asyncio.run(main())
        assert len(lags) >= PROBES, f"the loop turned {len(lags)} times during a step"
        median_ms = statistics.median(lags) * 1e3
        assert median_ms < 50, f"the loop answered in {median_ms:.1f} ms (median) during a step"
        assert steps_to_admit == 1  # all 32 taken in between two steps
        assert results[1].completions[0].finish_reason == "abort"
        for res in [results[0], *results[2:]]:
            assert len(res.completions[0].token_ids) == 8
        with front.paused() as engine:
            assert_no_blocks_in_use(engine)
    finally:
        held.free()
        front.stop()


def test_checks_come_back_at_once_and_capacity_from_the_engine_thread(tiny_dir) -> None:
    front = slow_front(tiny_dir, max_waiting=2, max_num_seqs=1)
    held = HeldSteps(front.engine)
    try:
        held.hold()
        front.add_request(PROMPT, SamplingParams(max_tokens=1))
        assert held.wait_in_step(1)
        with pytest.raises(InvalidRequest) as bad:  # while a step runs: checked here
            front.add_request([1] * 5000, SamplingParams())
        assert bad.value.field == "prompt"
        assert held.release(), "the check waited for the step in progress"
        held.free()
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
        held.free()
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
        with EngineLoop(engine) as front:
            await asyncio.gather(
                *(
                    front.add_async(front.check(PROMPT, params, request_id=f"r{i}", sink=sink))
                    for i in range(10)
                )
            )
            await asyncio.wait_for(sink.done.wait(), 60)
            with front.paused() as paused:
                assert_no_blocks_in_use(paused)
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
