"""The worker's intake: one router loop turn's requests in one call (``WorkerServer.submit_many``),
claimed, keyed and pulled on the actor's loop in turns of ``LOOP_SLICE_S`` and taken in by the
engine thread with one command and one answer (``EngineLoop.add_requests_async``), so that
128 requests at once never hold the loop for long."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvstore.blocks.hashing import BlockKey
from kvstore.requests.errors import UnknownChannel
from kvstore.requests.protocol import Admitted, PullReport, WorkerRequest
from kvstore.runtime.pauses import LoopSlices
from worker.engine.commands import AddRequest
from worker.index_link import IndexLink
from worker.kv import block_keys
from worker.pull.peer import PeerPulls
from worker.pull.warm import WarmStarts
from worker.telemetry import WorkerTelemetry
from worker.worker_outputs import WorkerOutputs

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.engine.engine_loop import EngineLoop


class BurstIntake:
    """Turns routers' :class:`WorkerRequest` bursts into the engine loop's adds. ``engine``
    is read only for its fixed facts (block size, hash contexts)."""

    def __init__(
        self,
        engine: Engine,
        engine_loop: EngineLoop,
        outputs: WorkerOutputs,
        pulls: PeerPulls,
        warm: WarmStarts,
        telemetry: WorkerTelemetry,
        index: IndexLink,
    ) -> None:
        self.engine = engine
        self.engine_loop = engine_loop
        self.outputs = outputs
        self.pulls = pulls
        self.warm = warm
        self.telemetry = telemetry
        self.index = index
        self.worker_id = index.worker_id

    async def submit_many(
        self, requests: list[WorkerRequest], caller: Any, channel_id: str
    ) -> list[Admitted | Exception]:
        """One router loop turn's requests for this worker, each answered on its own, in
        order: its :class:`Admitted` or, in its place, the error that refused it. A burst
        holds this loop for no more than a slice at a time: claims, keys and checks run in
        turns of ``LOOP_SLICE_S``, and the engine thread takes the whole burst in with one
        command and one answer."""
        outputs = self.outputs
        try:
            ch = outputs.submit_channel(channel_id, caller)
        except UnknownChannel as exc:
            return [exc for _ in requests]
        results: list[Admitted | Exception | None] = [None] * len(requests)
        slices = LoopSlices()
        keyed: list[tuple[int, WorkerRequest, list[BlockKey]]] = []
        claimed: list[str] = []  # ids taken here: given back if this call does not answer
        try:
            for i, request in enumerate(requests):
                rid = request.request_id
                try:
                    outputs.live.claim(rid)  # first: a duplicate leaves the live one as it was
                except Exception as exc:  # noqa: BLE001 - this request's answer
                    results[i] = exc
                    continue
                claimed.append(rid)
                try:
                    keys = self._keys(request)
                except Exception as exc:  # noqa: BLE001 - this request's answer
                    outputs.live.release(claimed.pop())
                    results[i] = exc
                else:
                    keyed.append((i, request, keys))
                    self.telemetry.arrived(rid)
                await slices.tick()
            pulls = await self._pulls_for([(r, keys) for _, r, keys in keyed], slices)
            adds = []
            for _, request, keys in keyed:
                rid = request.request_id
                outputs.opened(ch, rid)
                adds.append(
                    AddRequest(rid, request.token_ids, request.params, keys, ch, request.continued)
                )
                await slices.tick()
            errors = await self.engine_loop.add_requests_async(adds, slices)
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

    def _keys(self, request: WorkerRequest) -> list[BlockKey]:
        """The prompt's block keys, hashed once here and not by the engine thread: the
        scheduler's queue claims and the router's parity check use the same keys."""
        return block_keys(
            request.token_ids,
            self.engine.config.block_size,
            self.engine.hash_context(request.params),
        )

    async def _pulls_for(
        self, keyed: list[tuple[WorkerRequest, list[BlockKey]]], slices: LoopSlices
    ) -> list[PullReport | None]:
        """Each request's pull (``PeerPulls.pull_for``): concurrently where one may wait (a
        pull of its own, or one in flight it may land on), else one after another (no task
        each)."""
        for r, k in keyed:
            self.warm.note_served(r, k)
        pull_for = self.pulls.pull_for
        if self.pulls.landing or any(r.pull is not None for r, _ in keyed):
            return list(await asyncio.gather(*(pull_for(r, k) for r, k in keyed)))
        reports = []
        for r, k in keyed:
            reports.append(await pull_for(r, k))
            await slices.tick()
        return reports

    def _admitted(
        self, request: WorkerRequest, keys: list[BlockKey], pulled: PullReport | None
    ) -> Admitted:
        last = keys[-1] if request.want_keys and keys else None
        return Admitted(self.worker_id, self.index.epoch, last, pulled)

    def _refused(self, ch: Any, request_id: str) -> None:
        self.outputs.refused(ch, request_id)
        self.telemetry.forget(request_id)
