"""The forward window: an export of cached blocks runs while the model computes a step (the
step in flight never delays it), gives the bytes an export between steps gives, and leaves
no pin behind; a call between steps still waits for the step."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.commands import ExportRun, Snapshot
from worker.engine.engine_loop import EngineLoop
from worker.engine.kv_pull import export_run
from worker.kv import block_keys
from worker.model.build_tiny import build_tiny_model

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("window") / "llama", "llama")


def prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_export_runs_during_the_forward_not_after_it(model_dir) -> None:
    engine = Engine.from_model_dir(
        model_dir, EngineConfig(block_size=BS, num_blocks=64), model_id="tiny"
    )
    hot = prompt(1)
    engine.generate([hot], GREEDY)  # cached: 4 full blocks
    ctx = engine.hash_context(GREEDY)
    keys = block_keys(hot, BS, ctx)
    between = export_run(engine, keys, ctx)
    assert between is not None and len(between.header) == 4
    in_forward, release = threading.Event(), threading.Event()
    execute = engine.executor.execute

    def slow_execute(chunks):  # noqa: ANN001, ANN202 - the runner's own signature
        in_forward.set()
        assert release.wait(30), "the test never released the forward"
        return execute(chunks)

    engine.executor.execute = slow_execute
    front = EngineLoop(engine).start()
    try:

        async def go():
            stream = await front.add_request_async(prompt(2), GREEDY, request_id="busy")
            assert await asyncio.to_thread(in_forward.wait, 30)
            run = await front.export_async(ExportRun(tuple(keys), ctx), 5.0)
            between_steps = asyncio.ensure_future(front.call_async(Snapshot()))
            await asyncio.sleep(0.2)
            waited = not between_steps.done()  # the step in flight holds it up
            release.set()
            await between_steps
            async for _ in stream:
                pass
            return run, waited

        run, waited = asyncio.run(go())
    finally:
        release.set()
        front.stop()
    assert waited
    assert front.window.opened >= 1
    assert run is not None and run.header.keys == between.header.keys
    assert np.array_equal(run.payload.data, between.payload.data)
    assert engine.snapshot().kv_used_blocks == 0  # the export's pins are gone


def test_a_window_that_never_opens_times_out(model_dir) -> None:
    engine = Engine.from_model_dir(
        model_dir, EngineConfig(block_size=BS, num_blocks=64), model_id="tiny"
    )
    ctx = engine.hash_context(GREEDY)
    keys = block_keys(prompt(1), BS, ctx)  # not cached here: the export finds none
    front = EngineLoop(engine).start()
    try:
        with front.window.lock:  # as the engine thread holds it outside a forward

            async def go():
                return await front.export_async(ExportRun(tuple(keys), ctx), 0.2)

            with pytest.raises(TimeoutError, match="forward window"):
                asyncio.run(go())
        assert asyncio.run(front.export_async(ExportRun(tuple(keys), ctx), 1.0)) is None
    finally:
        front.stop()
