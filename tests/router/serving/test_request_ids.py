"""Client request ids are labels: a reused id never reaches or stops another request.

The directory below behaves like a worker's engine where ids matter: a duplicate live id is
refused, an abort ends the request with that id. Tenant A's request runs; tenant B sends the
same client id while it does. B is served on its own and A's stream completes untouched
(before ids were scoped, B was refused and the router's cleanup aborted A's request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from kvstore.index_types import WorkerLoad
from kvstore.requests.outputs import CompletionDelta, FinishReason
from kvstore.requests.protocol import Admitted, WorkerRequest, WorkerStatus
from router.placement.config import RoutingConfig
from router.placement.router import Router
from router.serving.core import ModelLimits, ServingCore
from router.serving.workers import WorkerDirectory
from worker.engine import InvalidRequest, RequestOutput, SamplingParams, Usage

IDLE = WorkerLoad(running=0, waiting=0, free_blocks=100, total_blocks=100, queued_prefill_tokens=0)
LIMITS = ModelLimits("m", vocab_size=1000, max_model_len=4096, max_prompt_tokens=4095)


class OneEngine(WorkerDirectory):
    """One worker with an engine's id rules; streams wait for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.live: dict[str, asyncio.Event] = {}  # engine id -> aborted
        self.aborted: list[str] = []
        self.admitted: list[str] = []

    async def candidates(self) -> Mapping[str, WorkerLoad]:
        return {"w0": IDLE}

    async def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        rid = request.request_id
        if rid in self.live:
            raise InvalidRequest("request_id", rid, "must be unique among live requests")
        aborted = self.live[rid] = asyncio.Event()
        self.admitted.append(rid)
        try:
            yield Admitted(worker_id, 1, None)
            done = asyncio.ensure_future(self.release.wait())
            gone = asyncio.ensure_future(aborted.wait())
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
            gone.cancel()
            reason = FinishReason.ABORT if aborted.is_set() else FinishReason.LENGTH
            yield RequestOutput(
                rid,
                [CompletionDelta(0, "x", [7], finish_reason=reason)],
                True,
                Usage(len(request.token_ids), 0, 1),
            )
        finally:
            self.live.pop(rid, None)

    async def abort(self, worker_id: str, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self.live:
            self.live[request_id].set()

    async def statuses(self) -> list[WorkerStatus]:
        return []


async def _collect(core: ServingCore, rid: str, salt: str) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=1, cache_salt=salt)
    return [out async for _, out in core.generate(rid, [1, 2, 3], params)]


def test_reused_request_id_of_another_tenant_never_touches_the_original() -> None:
    async def main() -> tuple[list, list | BaseException, OneEngine]:
        directory = OneEngine()
        core = ServingCore(
            Router(RoutingConfig(policy="least_loaded"), block_size=16), directory, LIMITS
        )
        a = asyncio.create_task(_collect(core, "shared-id", "tenant:A"))
        while not directory.live:
            await asyncio.sleep(0.001)
        b = asyncio.create_task(_collect(core, "shared-id", "tenant:B"))
        while len(directory.admitted) < 2 and not b.done():
            await asyncio.sleep(0.001)
        directory.release.set()
        a_out = await a
        try:
            b_out = await b
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            b_out = exc
        core.close()
        return a_out, b_out, directory

    a_out, b_out, directory = asyncio.run(main())
    # A completes normally, under its own id as the client sees it
    assert [d.finish_reason for o in a_out for d in o.outputs] == [FinishReason.LENGTH]
    assert {o.request_id for o in a_out} == {"shared-id"}
    # B is served separately, not refused, and answered under its own label
    assert not isinstance(b_out, BaseException), b_out
    assert [d.finish_reason for o in b_out for d in o.outputs] == [FinishReason.LENGTH]
    assert {o.request_id for o in b_out} == {"shared-id"}
    # the two ran under distinct engine ids, neither of them the client's
    assert len(set(directory.admitted)) == 2 and "shared-id" not in directory.admitted
    assert directory.aborted == []
