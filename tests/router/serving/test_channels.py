"""Coalescing a lagging reader's outputs, and the per-request inbox of a router's channel."""

from __future__ import annotations

import asyncio
from dataclasses import fields

from kvstore.requests.outputs import (
    CompletionDelta,
    FinishReason,
    GenerationResult,
    RequestOutput,
    TokenLogprob,
    Usage,
    coalesce,
    pack_output,
    relabelled,
    unpack_output,
)
from router.serving.request_inbox import Inbox
from router.serving.workers import WorkerGone


def lp(t: int) -> TokenLogprob:
    return TokenLogprob(t, -0.5 * t, ((t, -0.5 * t), (t + 1, -9.0)))


def outputs() -> list[RequestOutput]:
    """Two samples streaming at different paces; sample 1 stops on a string, 0 on length."""
    return [
        RequestOutput(
            "r",
            [CompletionDelta(0, "a", [1], [lp(1)], cumulative_logprob=-0.5)],
            False,
            Usage(9, 4, 1),
        ),
        RequestOutput(
            "r",
            [
                CompletionDelta(0, "b", [2], [lp(2)], cumulative_logprob=-1.5),
                CompletionDelta(1, "x", [7], [lp(7)], cumulative_logprob=-3.5),
            ],
            False,
            Usage(9, 4, 3),
        ),
        RequestOutput("r", [], False, Usage(9, 4, 3)),  # a step with no news for it
        RequestOutput(
            "r",
            [
                CompletionDelta(
                    1, "y", [8], [lp(8)], FinishReason.STOP, "yz", cumulative_logprob=-7.5
                )
            ],
            False,
            Usage(9, 4, 4),
        ),
        RequestOutput(
            "r",
            [
                CompletionDelta(
                    0, "c", [3], [lp(3)], FinishReason.LENGTH, None, cumulative_logprob=-3.0
                )
            ],
            True,
            Usage(9, 4, 5),
        ),
    ]


def folded(outs: list[RequestOutput]) -> GenerationResult:
    res = GenerationResult("r", [])
    for out in outs:
        res.add(out)
    return res


def test_coalescing_keeps_every_token_in_order_with_its_ending() -> None:
    outs = outputs()
    merged = coalesce([unpack_output(pack_output(o)) for o in outs])
    assert merged.finished and merged.usage == Usage(9, 4, 5) and merged.error is None
    assert [d.index for d in merged.outputs] == [0, 1]
    zero, one = merged.outputs
    assert (zero.text, zero.token_ids, zero.finish_reason, zero.stop_reason) == (
        "abc",
        [1, 2, 3],
        FinishReason.LENGTH,
        None,
    )
    assert (one.text, one.token_ids, one.finish_reason, one.stop_reason) == (
        "xy",
        [7, 8],
        FinishReason.STOP,
        "yz",
    )
    assert [x.token_id for x in zero.logprobs] == [1, 2, 3] and zero.cumulative_logprob == -3.0
    assert one.cumulative_logprob == -7.5
    # folding the one merged output equals folding the five
    assert folded([merged]) == folded(outputs())
    # every split of the stream into consecutive runs folds to the same result
    for cut in range(1, len(outs)):
        assert folded([coalesce(outputs()[:cut]), coalesce(outputs()[cut:])]) == folded(outputs())


def test_coalescing_leaves_its_inputs_alone_and_keeps_the_last_error() -> None:
    outs = outputs()[:2]
    failed = RequestOutput("r", [], True, Usage(9, 4, 3), "internal error processing the request")
    merged = coalesce([*outs, failed])
    assert merged.error == failed.error and merged.finished
    assert outs[0].outputs[0].token_ids == [1]  # the first output's delta was copied, not grown


def test_relabelling_keeps_every_other_field() -> None:
    # every field a distinct object: one added to RequestOutput and not carried fails here
    o = RequestOutput(**{f.name: object() for f in fields(RequestOutput)})
    back = relabelled(o, "client-label")
    assert back is not o and back.request_id == "client-label"
    for f in fields(RequestOutput):
        if f.name != "request_id":
            assert getattr(back, f.name) is getattr(o, f.name), f.name


def test_an_inbox_hands_over_what_gathered_as_one_output_then_the_error() -> None:
    async def main() -> list:
        inbox = Inbox()
        assert not await inbox.wait(0.01)  # nothing: the stall timeout passes
        for out in outputs()[:3]:
            inbox.put(pack_output(out))
        gone = WorkerGone("worker died")
        inbox.put(gone)
        assert await inbox.wait(0.01)
        first = inbox.take()
        return [first, inbox.take(), inbox.items]

    first, second, rest = asyncio.run(main())
    assert isinstance(first, RequestOutput) and first.outputs[0].token_ids == [1, 2]
    assert first.outputs[1].token_ids == [7] and not first.finished
    assert isinstance(second, WorkerGone) and rest == []


def test_an_inbox_stops_at_the_finished_output() -> None:
    inbox = Inbox()
    for out in outputs():
        inbox.put(pack_output(out))
    inbox.put(pack_output(RequestOutput("r", [], True, Usage(9, 4, 5))))  # never read
    merged = inbox.take()
    assert merged.finished and merged.outputs[0].token_ids == [1, 2, 3]
    assert len(inbox.items) == 1


def test_a_waiting_reader_wakes_on_the_first_item() -> None:
    async def main() -> bool:
        inbox = Inbox()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, inbox.put, pack_output(outputs()[0]))
        return await inbox.wait(5.0)

    assert asyncio.run(main())


def test_a_reader_that_took_its_items_already_is_not_woken_to_nothing() -> None:
    async def main() -> tuple[bool, bool, bool, int]:
        inbox = Inbox()
        inbox.items.append(pack_output(outputs()[0]))  # came while its reader was busy
        assert await inbox.wait(5.0)  # the reader is back: it takes them at once
        first = inbox.take()
        waiting = asyncio.ensure_future(inbox.wait(0.05))
        await asyncio.sleep(0)  # it waits for more now
        woke = inbox.wake()  # the late wake-up of the message that brought them
        await asyncio.sleep(0)
        early = waiting.done()
        inbox.put(pack_output(outputs()[1]))
        return woke, early, await waiting, len(first.outputs[0].token_ids)

    woke, early, got_more, tokens = asyncio.run(main())
    assert (woke, early, got_more, tokens) == (False, False, True, 1)


def test_packing_keeps_the_prompt_logprobs() -> None:
    out = RequestOutput("r", [CompletionDelta(0, "a", [1], [lp(1)])], False, Usage(3, 0, 1))
    out.prompt_logprobs = [None, lp(4), lp(5)]
    back = unpack_output(pack_output(out))
    assert back == out
    later = RequestOutput("r", [CompletionDelta(0, "b", [2])], True, Usage(3, 0, 2))
    assert coalesce([back, later]).prompt_logprobs == [None, lp(4), lp(5)]


def test_a_channel_the_worker_refused_ends_with_the_workers_own_reason() -> None:
    """A worker's error reaches the router as a RayTaskError whose text is the worker's
    traceback; the channel's WorkerGone names the worker's exception instead."""
    from ray.exceptions import RayTaskError

    from kvstore.requests.errors import WireMismatch
    from router.serving.worker_channel import _first_line

    refused = WireMismatch("output channel: the peer has abc, this side has def")
    line = _first_line(RayTaskError("outputs", "Traceback (most recent call last): ...", refused))
    assert line == f"WireMismatch: {refused}"
    assert _first_line(RuntimeError("stream broke\nmore")) == "RuntimeError: stream broke"


def test_an_inbox_arms_one_stall_timer_per_request_not_one_per_token() -> None:
    """A reader that waits once per token: the stall timeout is one timer for the request
    (re-armed only when it fires), so the per-token cost has no timer churn."""
    tokens = 500

    async def main() -> tuple[int, int]:
        inbox = Inbox()
        loop = asyncio.get_running_loop()
        got = 0
        for i in range(tokens):
            loop.call_soon(inbox.put, pack_output(outputs()[0]))
            assert await inbox.wait(30.0)
            got += len(inbox.take().outputs[0].token_ids)
            assert i or inbox.timers == 1
        inbox.close()
        return inbox.timers, got

    timers, got = asyncio.run(main())
    assert (timers, got) == (1, tokens)


def test_an_inbox_stall_counts_from_the_wait_not_from_the_timer() -> None:
    """The one timer re-arms for a wait that began after it was armed: a reader that got
    an item just before the timer fired does not time out early, and still times out."""

    async def main() -> tuple[bool, float, int]:
        inbox = Inbox()
        loop = asyncio.get_running_loop()
        loop.call_later(0.15, inbox.put, pack_output(outputs()[0]))
        assert await inbox.wait(0.2)  # the item came at 0.15 s, the timer is due at 0.2 s
        inbox.take()
        start = loop.time()
        stalled = await inbox.wait(0.2)  # began at ~0.15 s: due ~0.35 s, not at 0.2 s
        return stalled, loop.time() - start, inbox.timers

    stalled, waited, timers = asyncio.run(main())
    assert not stalled and waited >= 0.2 - 1e-3 and timers == 2


def step(t: int, finished: bool = False) -> tuple:
    """One step's packed output of request ``r``: token ``t``."""
    reason = FinishReason.LENGTH if finished else None
    delta = CompletionDelta(0, str(t), [t], None, reason)
    return pack_output(RequestOutput("r", [delta], finished, Usage(3, 0, t)))


def test_an_interval_holds_the_reader_until_that_many_steps_came_but_never_the_first() -> None:
    """``stream_interval`` 3: the first token goes at once; then a message per 3 steps,
    and the last (finished) one at once with whatever came before it."""

    async def main() -> list[list[int]]:
        inbox = Inbox(3)
        got: list[list[int]] = []
        for t in range(1, 9):  # 8 steps, the 8th finishing
            inbox.put(step(t, finished=t == 8))
            if inbox.ready():
                assert await inbox.wait(5.0)
                got.append(inbox.take().outputs[0].token_ids)
        return got

    assert asyncio.run(main()) == [[1], [2, 3, 4], [5, 6, 7], [8]]


def test_an_interval_never_holds_an_error_or_a_stall_back() -> None:
    async def main() -> tuple:
        inbox = Inbox(4)
        inbox.put(step(1))
        first = inbox.take()  # the first token: not held
        waiting = asyncio.ensure_future(inbox.wait(5.0))
        inbox.put(step(2))
        await asyncio.sleep(0)
        held = not waiting.done()  # one of four steps: the reader sleeps on
        inbox.put(WorkerGone("worker died"))  # an error wakes it with what came before
        woke = await waiting
        merged, gone = inbox.take(), inbox.take()
        inbox.put(step(3))  # a slow worker: the stall timeout hands over what gathered
        timed_out = await inbox.wait(0.02)
        return first.outputs[0].token_ids, held, woke, merged, gone, timed_out, inbox.take()

    first, held, woke, merged, gone, timed_out, late = asyncio.run(main())
    assert first == [1] and held and woke
    assert merged.outputs[0].token_ids == [2] and isinstance(gone, WorkerGone)
    assert timed_out and late.outputs[0].token_ids == [3]
