"""The router's event loop keeps answering while one channel message is demultiplexed (no
Ray: the channel's demultiplexer and the inboxes its readers wait on).

A message of several steps' outputs for 256 requests (what a router that lagged gets); each
reader's write to its client is made slow on purpose (it holds the loop's thread). A probe
on the loop must keep answering within 50 ms, and every reader gets its request's outputs
of the message as one output, in order, exactly once. The test's heap is frozen first, as the
router's start-up heap is (``freeze_long_lived``): else a collection scanning it stalls the
loop by itself."""

from __future__ import annotations

import asyncio
import gc
import time

from kvstore.blocks.looplag import LoopLagProbe
from kvstore.blocks.outputs import CompletionDelta, RequestOutput, Usage, pack_output
from kvstore.blocks.pauses import freeze_long_lived
from router.serving.channels import WAKE_SLICE, Inbox, demultiplex

STREAMS = 256
STEPS = 4  # steps gathered in the message
WRITE_S = 0.0003  # one client write: 256 of them in one loop iteration would be ~77 ms


def write() -> None:
    """A client write's time on the loop's thread (busy, as a real one is: a sleep would
    last whatever the kernel's timer slack makes it)."""
    end = time.perf_counter() + WRITE_S
    while time.perf_counter() < end:
        pass


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


def test_a_large_channel_message_never_blocks_the_router_loop() -> None:
    assert WAKE_SLICE * WRITE_S < 0.02  # a slice of writes is well inside the bound

    async def main() -> tuple[float, dict[str, list[RequestOutput]]]:
        inboxes = {f"r{i}": Inbox() for i in range(STREAMS)}
        got: dict[str, list[RequestOutput]] = {rid: [] for rid in inboxes}

        async def reader(rid: str) -> None:
            inbox = inboxes[rid]
            while True:
                assert await inbox.wait(30.0)
                out = inbox.take()
                write()
                got[rid].append(out)
                if out.finished:
                    return

        readers = [asyncio.create_task(reader(rid)) for rid in inboxes]
        await asyncio.sleep(0)  # every reader waits on its inbox now
        probe = LoopLagProbe(0.002)
        probe.report(reset=True)
        await asyncio.sleep(0.01)  # the probe runs
        await demultiplex(message(list(inboxes), skip="gone"), inboxes)
        await asyncio.wait_for(asyncio.gather(*readers), 30)
        lag = probe.report()["max_lag_ms"]
        probe.stop()
        return lag, got

    freeze_long_lived()
    try:
        lag_ms, got = asyncio.run(main())
    finally:
        gc.unfreeze()  # the rest of the test session collects as it did
    assert lag_ms < 50, f"the router's loop stalled {lag_ms:.1f} ms demultiplexing a message"
    for rid, outs in got.items():
        assert len(outs) == 1, rid  # the message's outputs of one request as one output
        (out,) = outs
        assert out.request_id == rid and out.finished and out.usage == Usage(8, 0, STEPS)
        assert out.outputs[0].token_ids == [100 + s for s in range(STEPS)]
        assert out.outputs[0].text == "".join(f"<{s}>" for s in range(STEPS))
