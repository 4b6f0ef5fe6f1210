"""ServingCore over an in-process WorkerDirectory (our own ABC; no Ray, Redis or gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from typing import TypeVar

import pytest

from kvstore.index_types import WorkerLoad
from kvstore.requests.errors import EngineOverloaded
from kvstore.requests.outputs import CompletionDelta, FinishReason
from kvstore.requests.protocol import Admitted, WorkerRequest, WorkerStatus
from router.placement.config import RoutingConfig
from router.placement.router import Router
from router.serving.core import ClusterOverloaded, ModelLimits, ServingCore
from router.serving.workers import WorkerDirectory
from worker.engine import RequestOutput, SamplingParams, Usage

T = TypeVar("T")
IDLE = WorkerLoad(running=0, waiting=0, free_blocks=100, total_blocks=100, queued_prefill_tokens=0)


class HeldWorkers(WorkerDirectory):
    """Two idle workers whose heartbeats never change; streams wait for ``release``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.placed: list[str] = []
        self.requests: list[WorkerRequest] = []

    async def candidates(self) -> Mapping[str, WorkerLoad]:
        return {"w0": IDLE, "w1": IDLE}

    async def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        self.placed.append(worker_id)
        self.requests.append(request)
        yield Admitted(worker_id, 1, None)
        await self.release.wait()
        usage = Usage(len(request.token_ids), 0, 1)
        yield RequestOutput(
            request.request_id,
            [CompletionDelta(0, "x", [7], finish_reason=FinishReason.LENGTH)],
            True,
            usage,
        )

    async def abort(self, worker_id: str, request_id: str) -> None:
        return None

    async def statuses(self) -> list[WorkerStatus]:
        return []


LIMITS = ModelLimits("m", vocab_size=1000, max_model_len=4096, max_prompt_tokens=4095)


def serving(directory: WorkerDirectory, policy: str = "prefix_affinity") -> ServingCore:
    return ServingCore(Router(RoutingConfig(policy=policy), block_size=16), directory, LIMITS)


async def send(core: ServingCore, request_id: str, token_ids: list[int]) -> None:
    """One request through the core, its outputs read and dropped."""
    async for _ in core.generate(request_id, token_ids, SamplingParams(max_tokens=1)):
        pass


def test_burst_spreads_before_heartbeats_show_the_load() -> None:
    """Heartbeats lag: two prompts routed back to back must not both see idle workers."""

    async def main() -> list[str]:
        directory = HeldWorkers()
        core = serving(directory)
        first = asyncio.create_task(send(core, "a", [1] * 200))
        while not directory.placed:
            await asyncio.sleep(0.001)
        second = asyncio.create_task(send(core, "b", [2] * 200))
        while len(directory.placed) < 2:
            await asyncio.sleep(0.001)
        directory.release.set()
        await asyncio.gather(first, second)
        core.close()
        return directory.placed

    placed = asyncio.run(main())
    assert sorted(placed) == ["w0", "w1"], placed


def test_simultaneous_burst_spreads() -> None:
    """Eight distinct prompts sent at the same instant (all read the same idle heartbeats
    before any is placed) still split evenly: each decision sees the ones before it."""

    async def main() -> list[str]:
        directory = HeldWorkers()
        core = serving(directory)
        tasks = [asyncio.create_task(send(core, f"r{i}", [i + 1] * 200)) for i in range(8)]
        while len(directory.placed) < 8:
            await asyncio.sleep(0.001)
        directory.release.set()
        await asyncio.gather(*tasks)
        core.close()
        return directory.placed

    placed = asyncio.run(main())
    assert sorted(placed) == ["w0"] * 4 + ["w1"] * 4, placed


def test_only_a_router_that_hashes_prompts_asks_for_parity_keys() -> None:
    """Hashing a long prompt on the worker is wasted unless the router compares the keys."""

    async def main(policy: str) -> bool:
        directory = HeldWorkers()
        directory.release.set()
        core = serving(directory, policy)
        await send(core, "r", [3] * 100)
        core.close()
        return directory.requests[0].want_keys

    assert asyncio.run(main("prefix_affinity")) is True
    assert asyncio.run(main("round_robin")) is False
    assert asyncio.run(main("least_loaded")) is False


async def on_decide_thread(core: ServingCore, fn: Callable[[], T]) -> T:
    """``fn()`` on the core's decide thread (which owns the router), after everything
    queued there before it."""
    done: Future[T] = Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - the test's to see
            done.set_exception(exc)

    core._decide.call(call)
    return await asyncio.wait_for(asyncio.wrap_future(done), 30)


def test_a_placements_pending_claim_ends_after_its_first_token() -> None:
    """While a request waits for its first token its prefix is claimed for its worker (its
    siblings follow it there); once the token is back the claim ends ``pending_settle_s``
    later, not at the TTL: the index knows by then. The router's clock is the test's: the
    claim's end is exact, however late any thread runs."""
    now = [100.0]

    async def main() -> tuple[dict, dict, dict]:
        directory = HeldWorkers()
        config = RoutingConfig(pending_ttl_s=60.0, pending_settle_s=0.5)
        router = Router(config, block_size=16, clock=lambda: now[0])
        core = ServingCore(router, directory, LIMITS)
        assert len(router.pending) == 0
        task = asyncio.create_task(send(core, "a", [5] * 64))
        while not directory.placed:
            await asyncio.sleep(0.001)
        keys = await on_decide_thread(core, lambda: router.pending.keys())
        now[0] += 10.0  # in flight, no token yet: claimed past the settle time
        during = await on_decide_thread(core, lambda: router.pending.lookup(keys, now[0]))
        directory.release.set()
        await task  # its first token settled the claim, on the decide thread
        t = now[0]
        still = await on_decide_thread(core, lambda: router.pending.lookup(keys, t + 0.49))
        after = await on_decide_thread(core, lambda: router.pending.lookup(keys, t + 0.5))
        core.close()
        return during, still, after

    during, still, after = asyncio.run(main())
    assert during == {"w0": 4} or during == {"w1": 4}, during
    assert still == during  # for pending_settle_s more
    assert after == {}  # then no longer (the TTL is 60 s)


class OneSlotWorkers(HeldWorkers):
    """Two workers with room for one request each: a third is refused (queue full)."""

    def __init__(self) -> None:
        super().__init__()
        self.busy: set[str] = set()

    async def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        if worker_id in self.busy:
            raise EngineOverloaded(1, 1)
        self.busy.add(worker_id)
        try:
            async for item in super().stream(worker_id, request):
                yield item
        finally:
            self.busy.discard(worker_id)


def test_full_queues_refuse_cheaply_until_a_request_ends() -> None:
    """Once every worker refused a request, the next is refused before it is parsed (the
    edges call ``check_room`` first), until one of the router's requests ends."""

    async def main() -> None:
        directory = OneSlotWorkers()
        core = serving(directory)
        core.check_room()  # room: nothing refused yet
        held = [asyncio.create_task(send(core, f"r{i}", [i + 1] * 40)) for i in range(2)]
        while len(directory.busy) < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(ClusterOverloaded, match="full queue") as tried:
            await send(core, "r2", [9] * 40)
        with pytest.raises(ClusterOverloaded, match="before it was read") as unread:
            core.check_room()
        # the unread refusal still names each worker's limit, as the tried one did
        detail = str(tried.value).split("retry later. ", 1)[1]
        assert detail and detail in str(unread.value)
        directory.release.set()  # both held requests end: their slots are free
        await asyncio.gather(*held)
        core.check_room()
        await send(core, "r3", [9] * 40)
        core.close()

    asyncio.run(main())
