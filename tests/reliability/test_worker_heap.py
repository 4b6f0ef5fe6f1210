"""A served worker's heap after warm-up is frozen once more, at its first idle moment: what
its first requests loaded and built is never scanned again by a full collection, and no
live request's objects are frozen with it. No Ray: the plain class."""

from __future__ import annotations

import asyncio
import gc

from kvstore.blocks.outputs import OUTPUT_SCHEMA
from kvstore.blocks.pauses import WarmUpFreeze
from kvstore.blocks.protocol import WorkerRequest
from worker.actor import WorkerServer, WorkerSettings
from worker.engine import EngineConfig, SamplingParams
from worker.model.build_tiny import build_tiny_model

PROMPT = [9, 41, 7, 300, 12, 77, 5, 18]


def frozen(obj: object) -> bool:
    """``obj`` is in the permanent generation: no collection scans it. Asked of the object
    itself, not of ``gc.get_freeze_count()``, which drops whenever any frozen object is
    freed (by an earlier test's leftovers, another thread)."""
    return not any(o is obj for o in gc.get_objects())


def test_warm_up_freeze_waits_for_its_count_and_an_idle_moment() -> None:
    freeze = WarmUpFreeze(after=3)
    kept = [[i] for i in range(1000)]  # long-lived objects made after start-up
    try:
        assert not frozen(kept[0]) and not frozen(kept[-1])
        assert not freeze.request_ended(idle=True)  # 1 of 3
        assert not freeze.request_ended(idle=False)
        assert not freeze.request_ended(idle=False)  # 3 of 3, but a request is live
        assert not frozen(kept[0]) and not frozen(kept[-1])
        assert freeze.request_ended(idle=True)
        assert frozen(kept[0]) and frozen(kept[-1])
        assert not freeze.request_ended(idle=True)  # once
        assert freeze.done and freeze.ended == 4
    finally:
        gc.unfreeze()  # undo this test's freeze for the tests after it


def test_a_worker_freezes_after_its_warm_up_requests_once_idle() -> None:
    model = build_tiny_model(None, "llama", "tiny")
    server = WorkerServer(
        WorkerSettings("worker-t", str(model), "m", EngineConfig(num_blocks=128), None)
    )
    server.streams.warm_freeze = WarmUpFreeze(after=4)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main() -> tuple[bool, int]:
        ended: set[str] = set()
        progress = asyncio.Event()

        async def reader() -> None:
            async for items in server.outputs("ch", None, OUTPUT_SCHEMA):
                ended.update(i[0] for i in items if i[2])
                progress.set()

        task = asyncio.create_task(reader())
        await server.submit(WorkerRequest("long", PROMPT, long, False), None, "ch")
        for i in range(5):
            await server.submit(WorkerRequest(f"s{i}", [i, *PROMPT], short, False), None, "ch")
        while not {f"s{i}" for i in range(5)} <= ended:
            progress.clear()
            await progress.wait()
        frozen_while_busy = server.streams.warm_freeze.done  # 5 ended, "long" still live
        while "long" not in ended:
            progress.clear()
            await progress.wait()
        task.cancel()
        return frozen_while_busy, server.streams.warm_freeze.ended

    kept = [[i] for i in range(100)]  # made after the worker's start-up freeze
    try:
        assert not frozen(kept[0])
        frozen_while_busy, ended = asyncio.run(main())
        assert "long" not in server.streams.live
        assert not frozen_while_busy
        assert server.streams.warm_freeze.done and ended == 6  # at the first idle moment
        assert frozen(kept[0]) and frozen(kept[-1])
    finally:
        server.shutdown()
        gc.unfreeze()  # undo this test's freezes for the tests after it
