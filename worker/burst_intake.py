"""The worker's intake of a burst: one router loop turn's requests in one call
(``WorkerServer.submit_many``), keyed and checked on the actor's loop in turns of
``LOOP_SLICE_S`` and taken in by the engine thread with one command and one answer
(``worker/engine/burst.py``), so that 128 requests at once never hold the loop for long."""

from __future__ import annotations

import asyncio
from typing import Any

from kvstore.blocks.errors import UnknownChannel
from kvstore.blocks.pauses import LoopSlices
from kvstore.blocks.protocol import Admitted, PullReport, WorkerRequest
from worker.callers import CallerWatch
from worker.channels import Channel
from worker.engine.burst import Submission
from worker.engine.front import StreamingEngine
from worker.live_ids import LiveIds
from worker.telemetry import WorkerTelemetry


class BurstIntake:
    """Mixin of the worker actor: needs its ``front``, ``callers`` and ``telemetry``, and
    its ``_submit_channel``, ``_keys``, ``_admitted`` and (``PeerPulls``) ``_pull_for``."""

    front: StreamingEngine
    callers: CallerWatch
    telemetry: WorkerTelemetry
    live: LiveIds
    _landing: dict

    async def submit_many(
        self, requests: list[WorkerRequest], caller: Any, channel_id: str
    ) -> list[Admitted | Exception]:
        """One router loop turn's requests for this worker, each answered on its own, in
        order: its :class:`Admitted` or, in its place, the error that refused it (what
        :meth:`submit`, a burst of one, raises). A burst holds this loop for no more than a
        slice at a time: keys and checks run in turns of ``LOOP_SLICE_S``, and the engine
        thread takes the whole burst in with one command and one answer
        (``worker/engine/burst.py``)."""
        try:
            ch = self._submit_channel(channel_id, caller)
        except UnknownChannel as exc:
            return [exc for _ in requests]
        results: list[Admitted | Exception | None] = [None] * len(requests)
        slices = LoopSlices()
        keyed: list[tuple[int, WorkerRequest, list]] = []
        claimed: list[str] = []  # ids taken here: given back if this call does not answer
        try:
            for i, request in enumerate(requests):
                rid = request.request_id
                try:
                    self.live.claim(rid)  # first: a duplicate leaves the live one as it was
                except Exception as exc:  # noqa: BLE001 - this request's answer
                    results[i] = exc
                    continue
                claimed.append(rid)
                try:
                    keys = self._keys(request)
                except Exception as exc:  # noqa: BLE001 - this request's answer
                    self.live.release(claimed.pop())
                    results[i] = exc
                else:
                    keyed.append((i, request, keys))
                    self.telemetry.arrived(rid)
                await slices.tick()
            pulls = await self._pulls_for([(r, keys) for _, r, keys in keyed], slices)
            subs = []
            for _, request, keys in keyed:
                rid = request.request_id
                ch.open(rid)  # before the add: its first outputs may come before we resume
                self.callers.watch(rid, ch.caller)
                subs.append(Submission(request.token_ids, request.params, rid, keys, ch))
                await slices.tick()
            errors = await self.front.add_requests_async(subs, slices)
        except BaseException:  # (cancelled): none of these was answered
            for rid in claimed:
                self._refused(ch, rid)
            raise
        for (i, request, keys), pulled, error in zip(keyed, pulls, errors, strict=True):
            if error is None:
                results[i] = self._admitted(request, keys, pulled)
            else:
                self._refused(ch, request.request_id)
                results[i] = error
        return results  # type: ignore[return-value]

    async def _pulls_for(
        self, keyed: list[tuple[WorkerRequest, list]], slices: LoopSlices
    ) -> list[PullReport | None]:
        """:meth:`_pull_for` of each request: concurrently where one may wait (a pull of its
        own, or one in flight it may land on), else one after another (no task each)."""
        if self._landing or any(r.pull is not None for r, _ in keyed):
            return list(await asyncio.gather(*(self._pull_for(r, k) for r, k in keyed)))
        reports = []
        for r, k in keyed:
            reports.append(await self._pull_for(r, k))
            await slices.tick()
        return reports

    def _refused(self, ch: Channel, request_id: str) -> None:
        ch.requests.discard(request_id)
        self.callers.forget(request_id)
        self.telemetry.forget(request_id)
        self.live.release(request_id)
