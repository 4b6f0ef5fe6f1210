"""A router that lags its worker's steps reads every message already there before waking
its readers: a real Ray stream from a worker-shaped actor, the router's loop held up while
the messages arrive; each reader then gets those steps' tokens as one output, in order,
every token exactly once, its end on the last."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from kvstore.requests.outputs import CompletionDelta, RequestOutput, Usage, pack_output
from router.serving.worker_channel import MAX_JOINED, WorkerChannel
from tests.embedded_ray import shared_ray

pytestmark = pytest.mark.ray
STEPS = MAX_JOINED + 2  # more than one batch joins


@ray.remote(num_cpus=0)
class Steps:
    """A worker's ``outputs`` channel: once released, one message per step at once."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    def release(self) -> None:
        self.go.set()

    async def outputs(self, channel_id: str, caller: object, schema: str):
        await self.go.wait()
        for s in range(STEPS):
            yield [
                pack_output(
                    RequestOutput(
                        rid,
                        [CompletionDelta(0, f"<{s}>", [100 + s])],
                        s == STEPS - 1,
                        Usage(8, 0, s + 1),
                    )
                )
                for rid in ("a", "b")
            ]


@pytest.fixture(scope="module")
def ray_local() -> None:
    shared_ray()


def test_a_lagging_router_joins_the_messages_there_and_keeps_every_token(ray_local) -> None:
    steps = Steps.remote()

    async def main() -> tuple[dict[str, list[RequestOutput]], int, int]:
        ch = WorkerChannel("w0", steps, "incarnation")
        inboxes = {rid: ch.open(rid) for rid in ("a", "b")}
        await asyncio.sleep(0.2)  # the channel is open at the worker
        ray.get(steps.release.remote())
        time.sleep(1.0)  # the router's loop is busy while every step's message arrives
        got: dict[str, list[RequestOutput]] = {"a": [], "b": []}

        async def read(rid: str) -> None:
            while not (got[rid] and got[rid][-1].finished):
                assert await inboxes[rid].wait(10)
                got[rid].append(inboxes[rid].take())

        await asyncio.wait_for(asyncio.gather(read("a"), read("b")), 30)
        ch.stop()
        return got, ch.messages, ch.joined

    got, batches, joined = asyncio.run(main())
    assert (batches, joined) == (2, STEPS - 2)  # MAX_JOINED of them, then the other two
    for outs in got.values():
        assert len(outs) == 2  # one output per batch, not one per step
        tokens = [t for o in outs for d in o.outputs for t in d.token_ids]
        assert tokens == [100 + s for s in range(STEPS)]
        assert "".join(d.text for o in outs for d in o.outputs) == "".join(
            f"<{s}>" for s in range(STEPS)
        )
        assert [o.finished for o in outs] == [False, True]
        assert outs[-1].usage.completion_tokens == STEPS
