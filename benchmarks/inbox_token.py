"""The router's CPU per streamed token in its output channels: a step's message split into
per-request inboxes (``demultiplex``), each request's reader woken, taking its output.

No Ray, no client: one process, one loop, ``--streams`` readers, ``--steps`` messages of one
output per stream. Measured as process CPU time per token (the best of ``--repeat`` rounds).
The baseline, in the same run, is an inbox that arms a stall timer on every wait (one per
token, cancelled when the token comes) instead of :class:`Inbox`'s one timer per request.

    .venv/bin/python -m benchmarks.inbox_token            # full size, a few seconds
    .venv/bin/python -m benchmarks.inbox_token --smoke    # well under a second
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.common import emit_json, print_table
from kvstore.blocks.outputs import CompletionDelta, RequestOutput, Usage, pack_output
from router.serving.request_inbox import Inbox
from router.serving.worker_channel import demultiplex

STALL_S = 30.0  # a stall timeout that never passes here: only its bookkeeping costs


class TimerPerWait(Inbox):
    """The baseline: a stall timer armed and cancelled on every wait."""

    async def wait(self, timeout_s: float) -> bool:
        if self.items:
            return True
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _stalled, w)
        try:
            return await w
        finally:
            timer.cancel()
            self._waiter = None


def _stalled(w: asyncio.Future) -> None:
    if not w.done():
        w.set_result(False)


async def _round(kind: type[Inbox], streams: int, steps: int) -> tuple[float, int]:
    """CPU seconds per token for ``streams`` readers over ``steps`` messages, and the
    tokens read (all of them, checked)."""
    inboxes = {f"r{i}": kind() for i in range(streams)}
    loop = asyncio.get_running_loop()
    tokens = 0
    taken = 0
    step_done: asyncio.Future = loop.create_future()

    async def reader(inbox: Inbox) -> None:
        nonlocal tokens, taken, step_done
        while True:
            assert await inbox.wait(STALL_S)
            out = inbox.take()
            tokens += len(out.outputs[0].token_ids)
            taken += 1
            if taken == streams:
                step_done.set_result(None)
            if out.finished:
                inbox.close()
                return

    readers = [asyncio.create_task(reader(ib)) for ib in inboxes.values()]
    await asyncio.sleep(0)
    messages = [
        [
            pack_output(
                RequestOutput(
                    rid, [CompletionDelta(0, "t", [s])], s == steps - 1, Usage(8, 0, s + 1)
                )
            )
            for rid in inboxes
        ]
        for s in range(steps)
    ]
    start = time.process_time()
    for items in messages:
        taken = 0
        step_done = loop.create_future()
        await demultiplex(items, inboxes)
        await step_done
    await asyncio.gather(*readers)
    return (time.process_time() - start) / (streams * steps), tokens


def run(streams: int, steps: int, repeat: int) -> tuple[list[dict], dict]:
    best: dict[str, float] = {}
    for _ in range(repeat):
        for kind in (TimerPerWait, Inbox):
            cpu, tokens = asyncio.run(_round(kind, streams, steps))
            assert tokens == streams * steps, (kind.__name__, tokens)
            best[kind.__name__] = min(best.get(kind.__name__, cpu), cpu)
    base, now = best["TimerPerWait"] * 1e6, best["Inbox"] * 1e6
    rows = [
        {"inbox": "stall timer per wait (baseline)", "cpu_us_per_token": round(base, 3)},
        {"inbox": "one stall timer per request", "cpu_us_per_token": round(now, 3)},
    ]
    head = {
        "inbox_token_cpu_us": round(now, 3),
        "inbox_token_cpu_us_baseline": round(base, 3),
        "inbox_token_cpu_ratio": round(now / base, 3),
        "inbox_streams": streams,
        "inbox_steps": steps,
    }
    return rows, head


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.streams, args.steps, args.repeat = 16, 10, 1
    rows, head = run(args.streams, args.steps, args.repeat)
    print_table(rows, f"router CPU per streamed token, {args.streams} streams x {args.steps} steps")
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
