"""A loop stall seen by ``LoopLagProbe(trace)``: the tracer, made on the loop's thread,
samples that thread's stack (the function that held the loop) while the loop is late."""

from __future__ import annotations

import asyncio
import time

from kvstore.runtime.looplag import LoopLagProbe


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # releases the GIL: the watchdog samples meanwhile


def test_a_stall_is_attributed_to_the_frame_that_held_the_loop() -> None:
    async def main() -> dict:
        probe = LoopLagProbe(0.002)
        probe.report(trace=True)  # starts the probe
        await asyncio.sleep(0.01)
        probe.report(trace=True)  # the tracer, made here on the loop's thread
        await asyncio.sleep(0.01)
        hold_the_loop(0.1)
        await asyncio.sleep(0.01)
        try:
            return probe.report()["trace"]
        finally:
            probe.stop()

    trace = asyncio.run(main())
    worst = trace["stalls"][0]
    assert worst["lag_ms"] >= 90, worst
    frames = [f for stack in worst["stacks"] for f in stack["frames"]]
    assert any(f.endswith(" hold_the_loop") for f in frames), worst
    assert worst["loop_cpu_ms"] < worst["lag_ms"]  # asleep, not computing
