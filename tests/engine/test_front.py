"""The streaming front: concurrent requests from threads and asyncio, aborts, hooks, stop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore.blocks.pauses import LoopSlices
from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import (
    Engine,
    EngineConfig,
    EngineLoop,
    EngineStopped,
    FinishReason,
    InvalidRequest,
    SamplingParams,
)
from worker.engine.commands import AddRequest
from worker.engine.streams import OutputSink

PROMPTS = [[5 + i, 40 + 3 * i, 77, 300 - i] * (i + 1) for i in range(5)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, min_tokens=4)


@pytest.fixture
def front(tiny_dir):
    events: list = []

    def on_step(engine: Engine, outputs) -> None:
        events.extend(engine.drain_kv_events())

    with EngineLoop(
        Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=128)), on_step=on_step
    ) as f:
        f.kv_events = events
        yield f


@pytest.fixture(scope="module")
def offline(tiny_dir) -> list[list[int]]:
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=128))
    return [r.completions[0].token_ids for r in engine.generate(PROMPTS, PARAMS)]


def idle_and_clean(front: EngineLoop) -> None:
    with front.paused() as engine:
        assert not engine.has_unfinished_requests()
        assert_no_blocks_in_use(engine)


def test_concurrent_threads_get_their_own_streams(front, offline) -> None:
    results: dict[int, list] = {}

    def client(i: int) -> None:
        stream = front.add_request(PROMPTS[i], PARAMS)
        outs = list(stream)
        results[i] = outs

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, outs in results.items():
        tokens = [t for o in outs for d in o.outputs for t in d.token_ids]
        assert tokens == offline[i]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert len(outs) >= 2  # streamed, not one final blob
    assert len(results) == len(PROMPTS)
    assert front.kv_events  # the on_step hook saw the KV manager's events
    idle_and_clean(front)


def test_asyncio_streams_and_abort_mid_stream(front, offline) -> None:
    async def main():
        streams = [await front.add_request_async(p, PARAMS) for p in PROMPTS[:3]]
        long = await front.add_request_async(
            PROMPTS[4], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, n=2)
        )

        async def abort_after(stream, k):
            outs = []
            async for out in stream:
                outs.append(out)
                if len(outs) == k:
                    assert stream.abort()
            return outs

        done = await asyncio.gather(*(s.acollect() for s in streams), abort_after(long, 3))
        return done[:3], done[3]

    results, aborted = asyncio.run(main())
    for i, res in enumerate(results):
        assert res.completions[0].token_ids == offline[i]
    assert aborted[-1].finished
    assert {d.finish_reason for d in aborted[-1].outputs} == {FinishReason.ABORT}
    assert aborted[-1].usage.completion_tokens < 2 * 500
    idle_and_clean(front)


def test_cancelling_an_async_consumer_aborts_the_request(front) -> None:
    async def main():
        stream = await front.add_request_async(
            PROMPTS[2], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        )

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # the abort lands with the next step
            with front.paused() as engine:
                unfinished = engine.has_unfinished_requests()
            if not unfinished:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    idle_and_clean(front)


def test_errors_are_raised_in_the_callers_thread(front) -> None:
    with pytest.raises(InvalidRequest) as exc:
        front.add_request([1] * 5000, PARAMS)
    assert exc.value.field == "prompt"
    stream = front.add_request(PROMPTS[0], PARAMS)

    async def wrong_kind_of_loop() -> None:
        async for _ in stream:
            pass

    with pytest.raises(TypeError, match="created by add_request: use `for`"):
        asyncio.run(wrong_kind_of_loop())
    assert stream.collect().finished


def test_stop_ends_every_stream(tiny_dir) -> None:
    front = EngineLoop(Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=64))).start()
    stream = front.add_request(PROMPTS[1], SamplingParams(max_tokens=1500, ignore_eos=True))
    first = next(iter(stream))
    assert not first.finished
    front.stop()
    outs = list(stream)
    assert outs and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason is FinishReason.ABORT
    assert_no_blocks_in_use(front.engine)
    with pytest.raises(EngineStopped):
        front.add_request(PROMPTS[0], PARAMS)


class _Collect(OutputSink):
    """A sink on a loop: every item, by request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: dict[str, list] = {}
        self.deliveries = 0
        self.ended = asyncio.Event()
        self.open = 0

    def deliver(self, items: list) -> None:
        self.deliveries += 1
        for item in items:
            self.items.setdefault(item.request_id, []).append(item)
            if item.finished:
                self.open -= 1
        if self.open == 0:
            self.ended.set()


def test_a_burst_is_checked_in_turns_and_answered_once_each_request_alone(front, offline) -> None:
    """``add_requests_async``: every request's answer in its place (a refused one refuses no
    other), the check yields the loop after each request when the turn budget is 0, and the
    requests' outputs are those of the offline engine."""
    too_long = [1] * 5000

    async def main() -> tuple:
        sink = _Collect(asyncio.get_running_loop())
        subs = [AddRequest(f"b{i}", p, PARAMS, None, sink) for i, p in enumerate(PROMPTS)]
        subs.insert(2, AddRequest("long", too_long, PARAMS, None, sink))
        subs.append(AddRequest("b0", PROMPTS[0], PARAMS, None, sink))  # a duplicate id
        sink.open = len(PROMPTS)
        slices = LoopSlices(0.0)
        results = await front.add_requests_async(subs, slices)
        await asyncio.wait_for(sink.ended.wait(), 60)
        return results, slices.yields, sink

    results, yields, sink = asyncio.run(main())
    assert yields == len(PROMPTS) + 2  # one turn per request checked
    assert [r is None for r in results] == [True, True, False, True, True, True, False]
    assert isinstance(results[2], InvalidRequest) and results[2].field == "prompt"
    assert isinstance(results[-1], InvalidRequest) and results[-1].field == "request_id"
    for i, want in enumerate(offline):
        got = [t for o in sink.items[f"b{i}"] for d in o.outputs for t in d.token_ids]
        assert got == want, i
    assert "long" not in sink.items
    idle_and_clean(front)


def test_a_burst_after_stop_is_refused_each(tiny_dir) -> None:
    front = EngineLoop(Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=64))).start()
    front.stop()

    async def main() -> list:
        sink = _Collect(asyncio.get_running_loop())
        subs = [AddRequest(f"s{i}", p, PARAMS, None, sink) for i, p in enumerate(PROMPTS)]
        return await front.add_requests_async(subs)

    results = asyncio.run(main())
    assert len(results) == len(PROMPTS)
    assert all(isinstance(r, EngineStopped) for r in results), results
