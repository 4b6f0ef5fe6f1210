"""A worker refuses a request whose id is live, on every way in (``submit``, ``submit_many``),
and the live request is unharmed: its channel still holds it (so its
router's death still aborts it), its caller is still watched, and its stream completes.
An id is free again once its stream ended, or when its request was refused. No Ray: the
plain class."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.outputs import OUTPUT_SCHEMA, FinishReason, unpack_output
from kvstore.requests.protocol import CallerRef, WorkerRequest
from worker.actor import WorkerServer, WorkerSettings
from worker.engine import EngineConfig, SamplingParams
from worker.model.build_tiny import build_tiny_model

PROMPT = [9, 41, 7, 300, 12, 77, 5, 18]
SLOW_STEP_S = 0.01  # the live request is still running when its duplicates arrive


@pytest.fixture
def server():
    model = build_tiny_model(None, "llama", "tiny")
    s = WorkerServer(WorkerSettings("worker-t", str(model), "m", EngineConfig(num_blocks=64), None))
    step = s.engine.step

    def slow() -> list:
        time.sleep(SLOW_STEP_S)
        return step()

    s.engine.step = slow  # type: ignore[method-assign]
    yield s
    s.shutdown()


def request(rid: str, prompt: list[int], max_tokens: int) -> WorkerRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return WorkerRequest(rid, prompt, params, False)


def refused(exc: BaseException) -> None:
    assert isinstance(exc, InvalidRequest), repr(exc)
    assert exc.field == "request_id" and exc.value == "r0"
    assert str(exc).startswith("invalid request_id='r0': ")


def test_a_duplicate_live_id_is_refused_and_the_live_request_runs_on(server) -> None:
    caller = CallerRef("a router's handle", "inc-1")
    cid = "inc-1/worker-t/0"

    async def main() -> tuple[list[int], list[int]]:
        tokens: dict[str, list[int]] = {}
        ends: dict[str, FinishReason | None] = {}
        done = asyncio.Event()

        async def reader() -> None:
            async for items in server.outputs(cid, caller, OUTPUT_SCHEMA):
                for item in items:
                    out = unpack_output(item)
                    tokens.setdefault(out.request_id, []).extend(
                        t for d in out.outputs for t in d.token_ids
                    )
                    if out.finished:
                        ends[out.request_id] = out.outputs[-1].finish_reason
                if {"r0", "r1"} <= set(ends):
                    done.set()

        task = asyncio.create_task(reader())
        await server.submit(request("r0", PROMPT, 40), caller, cid)
        await asyncio.sleep(5 * SLOW_STEP_S)
        assert server.engine_loop.is_live("r0")  # running
        other = [3, *PROMPT]
        with pytest.raises(InvalidRequest) as exc:
            await server.submit(request("r0", other, 40), "inc-1", cid)
        refused(exc.value)
        answers = await server.submit_many([request("r0", other, 40)], "inc-1", cid)
        refused(answers[0])  # type: ignore[arg-type]
        # the live one is as it was: its channel holds it, its caller is watched
        assert "r0" in server.streams.channels.find(cid).requests
        assert server.streams.callers.watched_requests().get("r0") is caller
        # a burst that holds the live id and a new one: only the duplicate is refused
        answers = await server.submit_many(
            [request("r0", other, 4), request("r1", other, 4)], "inc-1", cid
        )
        refused(answers[0])  # type: ignore[arg-type]
        assert not isinstance(answers[1], Exception)
        await asyncio.wait_for(done.wait(), 60)
        # ended: the id is free again, and a new request may take it
        assert "r0" not in server.streams.live and "r1" not in server.streams.live
        await server.submit(request("r0", other, 3), "inc-1", cid)
        task.cancel()
        return tokens["r0"], tokens["r1"]

    r0, r1 = asyncio.run(main())
    assert len(r0) == 40 and len(r1) == 4


def test_a_duplicate_leaves_the_live_request_abortable_by_its_routers_death(server) -> None:
    """What the refused duplicate used to break: a dead router's channel drop aborts every
    request it still ran, the live one with the reused id included."""
    caller = CallerRef("a router's handle", "inc-1")
    cid = "inc-1/worker-t/0"

    async def main() -> int:
        got: list[int] = []

        async def reader() -> None:
            async for items in server.outputs(cid, caller, OUTPUT_SCHEMA):
                for item in items:
                    out = unpack_output(item)
                    got.extend(t for d in out.outputs for t in d.token_ids)

        task = asyncio.create_task(reader())
        await server.submit(request("r0", PROMPT, 400), caller, cid)
        with pytest.raises(InvalidRequest):
            await server.submit(request("r0", [3, *PROMPT], 4), "inc-1", cid)
        await asyncio.sleep(5 * SLOW_STEP_S)
        server.streams.caller_died(caller)  # what the caller watch does for a dead router
        for _ in range(500):
            if not server.engine_loop.is_live("r0"):
                break
            await asyncio.sleep(0.01)
        assert not server.engine_loop.is_live("r0")  # aborted, not running on to 400 tokens
        task.cancel()
        return len(got)

    assert asyncio.run(main()) < 400


def test_a_cancelled_burst_gives_its_ids_back(server) -> None:
    """A ``submit_many`` cancelled while it keys its requests (its caller gave up) answers
    none of them and holds none of their ids: the same ids are admitted afterwards."""
    burst = [request(f"b{i}", [i % 200, *range(1, 512)], 2) for i in range(128)]

    async def main() -> list:
        task = asyncio.create_task(server.submit_many(burst, None, "ch"))
        await asyncio.sleep(0)  # it runs to its first turn's end (2 ms of keying)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(server.streams.live) == 0 and not server.streams.channels.get("ch").requests
        return await server.submit_many(burst[:2], None, "ch")

    answers = asyncio.run(main())
    assert not any(isinstance(a, Exception) for a in answers)
