"""The worker actor's event loop never waits for an engine step (no Ray: the plain class).

Steps are held in progress as long as the test needs (not timed); while one runs, requests
are submitted, then, during the next, one is aborted and status and block counts are asked:
a probe on the loop keeps answering (median < 50 ms, many times per step) and the test's
loop itself ends each step, so nothing it did waited for one. The channel then delivers
every request's outputs, in order, in one message per step at most."""

from __future__ import annotations

import asyncio
import statistics
import time

from kvstore.requests.outputs import OUTPUT_SCHEMA, unpack_output
from kvstore.requests.protocol import WorkerRequest, WorkerStatus
from tests.engine.helpers import HeldSteps, LoopTurns
from worker.actor import WorkerServer, WorkerSettings
from worker.engine import EngineConfig, SamplingParams
from worker.model.build_tiny import build_tiny_model

PROBES = 20  # answers of the loop's probe while one step is in progress
PROMPT = [9, 41, 7, 300, 12, 77, 5, 18]


def test_a_slow_step_never_blocks_the_worker_loop() -> None:
    model = build_tiny_model(None, "llama", "tiny")
    server = WorkerServer(
        WorkerSettings("worker-t", str(model), "m", EngineConfig(num_blocks=256), None)
    )
    held = HeldSteps(server.engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main() -> tuple[list[float], WorkerStatus, int, list]:
        batches: list = []
        done = asyncio.Event()
        expected = {f"r{i}" for i in range(17)}

        async def reader() -> None:
            async for items in server.outputs("ch", None, OUTPUT_SCHEMA):
                batches.append(items)
                finished = {i[0] for b in batches for i in b if i[2]}
                if finished >= expected:
                    done.set()
                    return

        task = asyncio.create_task(reader())
        probe = LoopTurns(0.002)
        held.hold()
        await server.submit(WorkerRequest("r0", PROMPT, params, False), None, "ch")
        assert await held.in_step(1)  # a step is in progress now, until the test ends it
        probe.start()
        submits = asyncio.gather(
            *(
                server.submit(WorkerRequest(f"r{i}", [i, *PROMPT], params, False), None, "ch")
                for i in range(1, 17)
            )
        )
        lags = await probe.answered(PROBES)
        assert held.release() and not submits.done(), "the worker's loop waited for a step"
        await asyncio.wait_for(submits, 30)  # taken in before the next step (held too)
        assert await held.in_step(2)
        server.abort("r16")
        asks = asyncio.gather(server.status(), server.kv_blocks_in_use())
        lags = await probe.answered(len(lags) + PROBES)
        assert held.release() and not asks.done(), "the worker's loop waited for a step"
        held.free()
        status, blocks = await asyncio.wait_for(asks, 30)
        probe.stop()
        await asyncio.wait_for(done.wait(), 60)
        await task
        return lags, status, blocks, batches

    try:
        lags, status, blocks, batches = asyncio.run(main())
        assert len(lags) >= 2 * PROBES, f"the loop turned {len(lags)} times in two steps"
        median_ms = statistics.median(lags) * 1e3
        assert median_ms < 50, f"the worker's loop answered in {median_ms:.1f} ms (median)"
        assert status.running + status.waiting >= 16 and blocks > 0
        tokens: dict[str, list[int]] = {}
        for batch in batches:
            for item in batch:
                out = unpack_output(item)
                tokens.setdefault(out.request_id, []).extend(
                    t for d in out.outputs for t in d.token_ids
                )
        assert all(len(tokens[f"r{i}"]) == 6 for i in range(16))
        assert len(tokens["r16"]) < 6  # aborted
        # one message per step at most, whatever its number of requests (a slow reader
        # gets several steps' outputs in one)
        assert len(batches) <= server.engine_loop.steps < sum(1 for b in batches for _ in b)
    finally:
        held.free()
        server.shutdown()


def test_a_reader_of_another_output_layout_is_refused_and_leaves_nothing_open() -> None:
    """``outputs`` refuses a router whose packed-output layout differs (or that sends none:
    an older version) before it opens anything; the right layout is served and watched."""
    from kvstore.requests.errors import WireMismatch
    from kvstore.requests.protocol import CallerRef

    model = build_tiny_model(None, "llama", "tiny")
    server = WorkerServer(
        WorkerSettings("worker-t", str(model), "m", EngineConfig(num_blocks=64), None)
    )
    caller = CallerRef("a router's handle", "inc-1")

    async def main() -> None:
        for schema in (None, "0123456789abcdef"):
            try:
                async for _ in server.outputs("inc-1/worker-t/0", caller, schema):
                    raise AssertionError("a batch was sent")
                raise AssertionError("not refused")
            except WireMismatch as exc:
                assert "output channel" in str(exc)
            assert (
                len(server.streams.channels) == 0
                and server.streams.callers.watched_channels() == {}
            )
        reader = server.outputs("inc-1/worker-t/1", caller, OUTPUT_SCHEMA)
        first = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0.05)
        assert server.streams.channels.ids() == ["inc-1/worker-t/1"]
        assert server.streams.callers.watched_channels() == {"inc-1/worker-t/1": caller}
        server.streams.channels.drop("inc-1/worker-t/1")
        try:
            await first
        except StopAsyncIteration:
            pass
        assert len(server.streams.channels) == 0 and server.streams.callers.watched_channels() == {}

    try:
        asyncio.run(main())
    finally:
        server.shutdown()


def test_a_burst_is_answered_in_place_while_the_loop_keeps_answering() -> None:
    """128 requests of 512 tokens in one ``submit_many``: each answered in its place (a
    refused one, its own error, refuses no other), every admitted one streams to its end,
    and the loop keeps answering while they are keyed, checked and taken in (one answer for
    the burst, not 128): no turn of the loop costs 10 ms of its CPU (taken one by one, the
    burst's checks ran in one turn of ~25 ms). CPU time, not a wall-clock probe: what the
    loop itself ran, whatever else the machine runs."""
    from kvstore.requests.errors import InvalidRequest
    from kvstore.requests.protocol import Admitted

    model = build_tiny_model(None, "llama", "tiny")
    cfg = EngineConfig(num_blocks=8192, max_waiting=256, max_num_seqs=64)
    server = WorkerServer(WorkerSettings("worker-t", str(model), "m", cfg, None))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    burst = [
        WorkerRequest(f"b{i}", [(i * 7 + j) % 500 + 1 for j in range(512)], params, False)
        for i in range(128)
    ]
    burst[40] = WorkerRequest("bad", [1] * 5000, params, False)  # over max_model_len

    async def main() -> tuple:
        got: dict[str, int] = {}
        done = asyncio.Event()

        async def reader() -> None:
            async for items in server.outputs("ch", None, OUTPUT_SCHEMA):
                for item in items:
                    out = unpack_output(item)
                    got[out.request_id] = got.get(out.request_id, 0) + sum(
                        len(d.token_ids) for d in out.outputs
                    )
                    if out.finished and len(got) == 127 and all(v == 2 for v in got.values()):
                        done.set()
                        return

        async def turns() -> None:  # the loop thread's CPU between two of this task's turns
            last = time.thread_time()
            while True:
                await asyncio.sleep(0)
                now = time.thread_time()
                longest[0], last = max(longest[0], now - last), now

        longest = [0.0]
        task = asyncio.create_task(reader())
        watch = asyncio.create_task(turns())
        await asyncio.sleep(0)
        longest[0] = 0.0
        results = await server.submit_many(burst, None, "ch")
        await asyncio.sleep(0)
        watch.cancel()
        turn_ms = longest[0] * 1e3
        await asyncio.wait_for(done.wait(), 120)
        await task
        return results, got, turn_ms

    try:
        results, got, turn_ms = asyncio.run(main())
        assert len(results) == 128
        assert isinstance(results[40], InvalidRequest) and results[40].field == "prompt"
        assert all(isinstance(r, Admitted) for i, r in enumerate(results) if i != 40)
        assert set(got) == {r.request_id for r in burst} - {"bad"}
        assert turn_ms < 10, f"one turn of the worker's loop ran {turn_ms:.1f} ms of CPU"
        assert not server.telemetry.awaiting_first_token("bad")  # a refused request leaves nothing
    finally:
        server.shutdown()
