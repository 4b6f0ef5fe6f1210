"""The worker actor's event loop never waits for an engine step (no Ray: the plain class).

Every step is made slow on purpose; while steps run, requests are submitted, one is
aborted, status and block counts are asked, and a probe on the loop must keep answering
within 50 ms. The channel then delivers every request's outputs, in order, in one message
per step."""

from __future__ import annotations

import asyncio
import time

from kvstore.blocks.looplag import LoopLagProbe
from kvstore.blocks.outputs import OUTPUT_SCHEMA, unpack_output
from kvstore.blocks.protocol import WorkerRequest
from worker.actor import WorkerServer, WorkerSettings
from worker.engine import EngineConfig, SamplingParams
from worker.model.build_tiny import build_tiny_model

SLOW_STEP_S = 0.15
PROMPT = [9, 41, 7, 300, 12, 77, 5, 18]


def test_a_slow_step_never_blocks_the_worker_loop() -> None:
    model = build_tiny_model(None, "llama", "tiny")
    server = WorkerServer(
        WorkerSettings("worker-t", str(model), "m", EngineConfig(num_blocks=256), None)
    )
    step = server.engine.step

    def slow() -> list:
        time.sleep(SLOW_STEP_S)
        return step()

    server.engine.step = slow  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main() -> tuple[float, dict, list]:
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
        probe = LoopLagProbe(0.002)
        await server.loop_lag(reset=True)
        await server.submit(WorkerRequest("r0", PROMPT, params, False), None, "ch")
        await asyncio.sleep(SLOW_STEP_S / 2)  # a step is running now
        probe.report(reset=True)
        await asyncio.gather(
            *(
                server.submit(WorkerRequest(f"r{i}", [i, *PROMPT], params, False), None, "ch")
                for i in range(1, 17)
            )
        )
        server.abort("r16")
        status = await server.status()
        blocks = await server.kv_blocks_in_use()
        assert status.running + status.waiting >= 16 and blocks > 0
        lag = max(probe.report()["max_lag_ms"], (await server.loop_lag())["max_lag_ms"])
        await asyncio.wait_for(done.wait(), 60)
        await task
        return lag, status, batches

    try:
        lag_ms, _, batches = asyncio.run(main())
        assert lag_ms < 50, f"the worker's loop stalled {lag_ms:.1f} ms during a step"
        tokens: dict[str, list[int]] = {}
        for batch in batches:
            rids = [item[0] for item in batch]
            assert len(rids) == len(set(rids))  # one output per request per message
            for item in batch:
                out = unpack_output(item)
                tokens.setdefault(out.request_id, []).extend(
                    t for d in out.outputs for t in d.token_ids
                )
        assert all(len(tokens[f"r{i}"]) == 6 for i in range(16))
        assert len(tokens["r16"]) < 6  # aborted
        assert len(batches) < sum(1 for b in batches for _ in b)  # batched
    finally:
        server.shutdown()
