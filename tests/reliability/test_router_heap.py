"""A serving router's heap after warm-up is frozen once more, at its first idle moment (no
request live in its core): what its first requests loaded and built is never scanned again
by a full collection, and no live request's objects are frozen with it. No Ray: the core
over an in-process worker directory."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Mapping

from kvstore.index_types import WorkerLoad
from kvstore.requests.outputs import CompletionDelta, FinishReason
from kvstore.requests.protocol import Admitted, WorkerRequest, WorkerStatus
from kvstore.runtime.pauses import WarmUpFreeze
from router.placement.config import RoutingConfig
from router.placement.router import Router
from router.serving.core import ModelLimits, ServingCore
from router.serving.workers import WorkerDirectory
from worker.engine import RequestOutput, SamplingParams, Usage

IDLE = WorkerLoad(running=0, waiting=0, free_blocks=100, total_blocks=100, queued_prefill_tokens=0)
LIMITS = ModelLimits("m", vocab_size=1000, max_model_len=4096, max_prompt_tokens=4095)


class GatedWorker(WorkerDirectory):
    """One idle worker; a request whose prompt starts with 0 waits for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def candidates(self) -> Mapping[str, WorkerLoad]:
        return {"w0": IDLE}

    async def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        yield Admitted(worker_id, 1, None)
        if request.token_ids[0] == 0:
            await self.release.wait()
        delta = CompletionDelta(0, "x", [7], finish_reason=FinishReason.LENGTH)
        yield RequestOutput(request.request_id, [delta], True, Usage(3, 0, 1))

    async def abort(self, worker_id: str, request_id: str) -> None:
        return None

    async def statuses(self) -> list[WorkerStatus]:
        return []


def test_a_router_freezes_after_its_warm_up_requests_once_idle() -> None:
    workers = GatedWorker()
    core = ServingCore(Router(RoutingConfig(), block_size=16), workers, LIMITS)
    core.warm_freeze = WarmUpFreeze(after=4)
    params = SamplingParams(max_tokens=1)

    async def send(name: str, token_ids: list[int]) -> str:
        async for worker, out in core.generate(name, token_ids, params):
            assert worker == "w0" and out.request_id == name
        return name

    async def main() -> tuple[bool, int, int]:
        held = asyncio.create_task(send("long", [0, 5, 6]))

        async def long_is_live() -> None:  # placed on the decide thread, then held
            while core.live_requests < 1:
                await asyncio.sleep(0.001)

        await asyncio.wait_for(long_is_live(), 30)
        assert core.live_requests == 1
        await asyncio.gather(*(send(f"s{i}", [i + 1, 5, 6]) for i in range(5)))
        frozen_while_busy = core.warm_freeze.done  # 5 ended, "long" still live
        live_then = core.live_requests
        workers.release.set()
        await held
        return frozen_while_busy, live_then, core.warm_freeze.ended

    try:
        gc.collect()
        before = gc.get_freeze_count()
        frozen_while_busy, live_then, ended = asyncio.run(main())
        assert not frozen_while_busy and live_then == 1
        assert core.warm_freeze.done and ended == 6  # at the first idle moment
        assert core.live_requests == 0
        assert gc.get_freeze_count() > before
    finally:
        core.close()
        # undo this test's freeze: frozen objects freed later would change the count under
        # the next test that reads it
        gc.unfreeze()
