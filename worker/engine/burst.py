"""A burst of requests taken in at once: checked on the caller's loop in short turns, added by
the engine thread in one command, answered with one wake-up of the caller's loop.

Added one by one, 128 requests cost the caller's event loop 128 checks back to back, then
128 futures completing together (one ``call_soon_threadsafe`` and one task step each) in
the same few ms: the loop stalls for every other call and stream. Here the checks yield the
loop every ``LOOP_SLICE_S`` (``kvstore/blocks/pauses.py``), and the engine thread answers the
whole burst with one future.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvstore.blocks.errors import EngineStopped
from kvstore.blocks.pauses import LoopSlices
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine.engine import Engine
from worker.engine.inbox import Command, Inbox
from worker.engine.intake import Prompt
from worker.engine.streams import OutputSink
from worker.kv import BlockKey


@dataclass(frozen=True, slots=True)
class Submission:
    """One request of a burst (see :meth:`BurstAdmission.add_requests_async`)."""

    prompt: Prompt
    params: SamplingParams
    request_id: str
    prompt_keys: Sequence[BlockKey] | None  # see Engine.add_request
    sink: OutputSink  # where its outputs go


def refuser(future: Future) -> Callable[[BaseException], None]:
    """A command's ``refuse`` (the engine stopped before it ran): ``future`` raises it."""

    def refuse(exc: BaseException) -> None:
        if future.set_running_or_notify_cancel():
            future.set_exception(exc)

    return refuse


class BurstAdmission:
    """The streaming front's burst intake (a mixin: the front owns these attributes)."""

    engine: Engine
    _inbox: Inbox
    _sinks: dict[str, OutputSink]

    def _take_in(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_keys: Sequence[BlockKey] | None,
        sink: OutputSink,
    ) -> None:
        """Engine thread: add a checked request and send its outputs to ``sink``."""
        self.engine.add_checked(rid, prompt_ids, params, prompt_keys)
        self._sinks[rid] = sink

    async def add_requests_async(
        self, subs: Sequence[Submission], slices: LoopSlices | None = None
    ) -> list[Exception | None]:
        """Queue ``subs`` from asyncio code; per submission, in order: None once the engine
        took it in, or the error that refused it (InvalidRequest from the check here or for
        a duplicate id, EngineOverloaded, EngineStopped). The loop never waits for a step and
        is given back every ``slices.budget_s`` while the requests are checked."""
        slices = slices or LoopSlices()
        results: list[Exception | None] = [None] * len(subs)
        checked: list[tuple[int, Submission, list[int]]] = []
        for i, sub in enumerate(subs):
            try:
                checked.append((i, sub, self.engine.check_request(sub.prompt, sub.params)))
            except Exception as exc:  # noqa: BLE001 - this request's answer, not the burst's
                results[i] = exc
            await slices.tick()
        if not checked:
            return results
        future: Future[dict[int, Exception]] = Future()

        def add() -> None:
            if not future.set_running_or_notify_cancel():
                return
            errors: dict[int, Exception] = {}
            for i, sub, prompt_ids in checked:
                try:
                    self._take_in(sub.request_id, prompt_ids, sub.params, sub.prompt_keys, sub.sink)
                except Exception as exc:  # noqa: BLE001 - the caller's error, raised there
                    errors[i] = exc
            future.set_result(errors)

        try:
            self._inbox.submit(Command(add, refuser(future)))
            errors = await asyncio.wrap_future(future)
        except EngineStopped as exc:
            errors = {i: exc for i, _, _ in checked}
        for i, exc in errors.items():
            results[i] = exc
        return results
