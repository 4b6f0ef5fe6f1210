"""The router's event loop keeps turning while one channel message is demultiplexed (no
Ray: the channel's demultiplexer and the inboxes its readers wait on).

A message of several steps' outputs for 256 requests (what a router that lagged gets); each
reader writes to its client when it wakes. A probe task, always ready, counts the writes
that ran between two of its turns: a loop iteration must never run a whole message's writes
(the loop-lag probes of ``benchmarks/serving_path.py`` saw 40-80 ms iterations of 256),
only a slice. Counted, not timed, so a busy machine cannot make it pass or fail. And every
reader gets its request's outputs of the message as one output, in order, exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvstore.requests.outputs import CompletionDelta, RequestOutput, Usage, pack_output
from router.serving.iteration_slices import IterationSlices
from router.serving.request_inbox import Inbox
from router.serving.worker_channel import WAKE_SLICE, demultiplex

STREAMS = 256
STEPS = 4  # steps gathered in the message


def message(rids: list[str], *, skip: str) -> list[tuple]:
    """Step by step, every request's output of that step (the worker's order), packed; the
    last step finishes them. ``skip`` left its inbox: its items are dropped."""
    return [
        pack_output(
            RequestOutput(
                rid, [CompletionDelta(0, f"<{s}>", [100 + s])], s == STEPS - 1, Usage(8, 0, s + 1)
            )
        )
        for s in range(STEPS)
        for rid in [*rids, skip]
    ]


async def gains_between_turns(request: Callable[[int], Awaitable[None]], order: list) -> list[int]:
    """Runs ``request(i)`` for each of :data:`STREAMS` at once beside an always-ready probe
    task; the entries ``order`` gained between each two of the probe's turns."""
    gains: list[int] = []
    done = False

    async def probe() -> None:
        last = 0
        while not done:
            await asyncio.sleep(0)
            gains.append(len(order) - last)
            last = len(order)

    spin = asyncio.create_task(probe())
    await asyncio.sleep(0)
    await asyncio.gather(*(request(i) for i in range(STREAMS)))
    done = True
    await spin
    return gains


def test_a_large_channel_message_never_blocks_the_router_loop() -> None:
    assert 2 * WAKE_SLICE < STREAMS  # else the bound below says nothing

    async def main() -> tuple[int, int, dict[str, list[RequestOutput]]]:
        inboxes = {f"r{i}": Inbox() for i in range(STREAMS)}
        got: dict[str, list[RequestOutput]] = {rid: [] for rid in inboxes}
        writes = 0
        most = turns = 0
        done = False

        async def reader(rid: str) -> None:
            nonlocal writes
            inbox = inboxes[rid]
            while True:
                assert await inbox.wait(30.0)
                out = inbox.take()
                writes += 1  # its write to the client, on the loop
                got[rid].append(out)
                if out.finished:
                    return

        async def probe() -> None:  # one turn per loop iteration
            nonlocal most, turns
            last = writes
            while not done:
                await asyncio.sleep(0)
                most, last, turns = max(most, writes - last), writes, turns + 1

        readers = [asyncio.create_task(reader(rid)) for rid in inboxes]
        await asyncio.sleep(0)  # every reader waits on its inbox now
        spin = asyncio.create_task(probe())
        await demultiplex(message(list(inboxes), skip="gone"), inboxes)
        await asyncio.wait_for(asyncio.gather(*readers), 30)
        done = True
        await spin
        return most, turns, got

    most, turns, got = asyncio.run(main())
    # the probe's turns interleave the slices: between two turns, at most two slices' writes
    assert 0 < most <= 2 * WAKE_SLICE, f"{most} client writes ran between two loop turns"
    assert turns >= STREAMS // WAKE_SLICE
    for rid, outs in got.items():
        assert len(outs) == 1, rid  # the message's outputs of one request as one output
        (out,) = outs
        assert out.request_id == rid and out.finished and out.usage == Usage(8, 0, STEPS)
        assert out.outputs[0].token_ids == [100 + s for s in range(STEPS)]
        assert out.outputs[0].text == "".join(f"<{s}>" for s in range(STEPS))


def test_a_burst_of_requests_reaches_its_first_step_a_slice_per_loop_turn() -> None:
    """256 requests arriving at once (their intake done in the same iteration) pass the
    directory's first-step gate a slice per loop iteration, in arrival order: a probe
    task, always ready, sees at most two slices' steps between two of its turns."""
    size = WAKE_SLICE
    assert 2 * size < STREAMS

    async def main() -> tuple[int, list[int], int]:
        slices = IterationSlices(size)
        order: list[int] = []

        async def request(i: int) -> None:
            await slices.enter()
            order.append(i)  # its submit, on the loop

        most = max(await gains_between_turns(request, order))
        return most, order, slices.deferred

    most, order, deferred = asyncio.run(main())
    assert 0 < most <= 2 * size, f"{most} first steps ran between two loop turns"
    assert order == list(range(STREAMS))
    assert deferred > 0


def test_a_burst_of_requests_is_taken_in_a_slice_per_loop_turn() -> None:
    """256 requests whose intake starts in one loop iteration (a burst of connections read
    together) pass the intake's turn gate a slice per iteration, in arrival order, each
    with its own prompt. Each takes one turn, as the gRPC edge does (the turn, the parse,
    the token ids): an always-ready probe sees exactly one slice's intakes between two of
    its turns whenever any ran, so no iteration runs a whole burst's validation and
    hand-off, and none runs half a slice (a request entering the gate twice)."""
    from protos.kvcluster.v1 import kvcluster_pb2 as pb
    from router.edge.convert import spec_from_pb
    from router.placement.config import RequestLimits
    from router.serving.edge_intake import INTAKE_SLICE, Intake
    from tests.router.http_api.test_http_hostile_bodies import Core, Tokenizer

    assert STREAMS % INTAKE_SLICE == 0 and 2 * INTAKE_SLICE < STREAMS

    async def main() -> tuple[list[int], list[int], list[list[int]]]:
        intake = Intake(Core(), Tokenizer(), auth=None, limits=RequestLimits())  # type: ignore[arg-type]
        order: list[int] = []
        prompts: list[list[int]] = []

        async def request(i: int) -> None:
            await intake.turn()
            spec = spec_from_pb(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5 + i, 6])))
            ids = await intake.token_ids(spec)
            order.append(i)
            prompts.append(ids)

        gains = await gains_between_turns(request, order)
        intake.close()
        return gains, order, prompts

    gains, order, prompts = asyncio.run(main())
    per_turn = [g for g in gains if g]
    assert per_turn == [INTAKE_SLICE] * (STREAMS // INTAKE_SLICE), per_turn
    assert order == list(range(STREAMS))
    assert prompts == [[5 + i, 6] for i in range(STREAMS)]
