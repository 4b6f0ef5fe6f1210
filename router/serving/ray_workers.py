"""The Ray-backed :class:`WorkerDirectory`: named worker actors, their liveness
(:class:`~router.serving.worker_liveness.WorkerLiveness`), requests and their outputs through
one channel per worker (:mod:`router.serving.output_channels`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import (
    GetTimeoutError,
)

from kvstore.index import KVIndex
from kvstore.index_types import WorkerLoad
from kvstore.requests.outputs import RequestOutput
from kvstore.requests.protocol import Admitted, CallerRef, WorkerRequest, WorkerStatus
from kvstore.runtime.looplag import LoopLagProbe
from router.placement.breaker import CircuitBreaker
from router.placement.config import STREAM_INTERVAL, LivenessConfig
from router.serving.answer_cache import AnswerCache
from router.serving.iteration_slices import IterationSlices
from router.serving.output_channels import Channels
from router.serving.submits import SubmitBatcher
from router.serving.worker_call_errors import ACTOR_ERRORS
from router.serving.worker_channel import WAKE_SLICE, WorkerChannel
from router.serving.worker_liveness import WorkerLiveness
from router.serving.workers import WorkerDirectory, WorkerGone

log = logging.getLogger(__name__)
STATUS_REUSE_S = 0.25  # how long one round of status calls answers statuses()


def _current_actor() -> ray.actor.ActorHandle | None:
    """This actor's own handle (None outside an actor, e.g. a test driver)."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


class RayWorkerDirectory(WorkerDirectory):
    def __init__(
        self,
        namespace: str,
        index: KVIndex | None,
        *,
        live_ttl_s: float = 0.1,
        dead_ttl_s: float = 10.0,
        call_timeout_s: float = 10.0,
        breaker: CircuitBreaker | None = None,
        timeouts: LivenessConfig | None = None,
        caller_actor: ray.actor.ActorHandle | None = None,
        stream_interval: int = STREAM_INTERVAL,
    ) -> None:
        """Outputs come through one channel per worker (one message per step for all of
        this router's requests there). ``stream_interval``: steps' tokens per client
        message at least (the channel's :class:`~router.serving.request_inbox.Inbox`).
        ``caller_actor``: the actor workers watch for this router's death (it answers
        ``incarnation()``); by default the actor this runs in, none outside one."""
        self.namespace = namespace
        self.liveness = WorkerLiveness(
            namespace, index, breaker=breaker, live_ttl_s=live_ttl_s, dead_ttl_s=dead_ttl_s
        )
        self.call_timeout_s = call_timeout_s
        self.timeouts = timeouts or LivenessConfig()  # stall, probe and status timeouts
        self.stalls = 0  # streams given up because their worker stopped answering
        self._handles: dict[str, ray.actor.ActorHandle] = {}
        self._lookups: dict[str, asyncio.Future] = {}  # worker -> its name lookup in flight
        self.lookups = 0  # name lookups sent to Ray's GCS (one per worker until it dies)
        # given to each worker (with a channel's first requests): it aborts the requests of
        # a router that died (or was restarted: a new incarnation id)
        self.incarnation = uuid.uuid4().hex
        handle = caller_actor or _current_actor()
        self.caller = CallerRef(handle, self.incarnation) if handle is not None else None
        self.stream_interval = stream_interval
        self.channels = Channels(self.incarnation, self.caller)
        self.submits = SubmitBatcher(self.caller, self.incarnation)
        self._probes: dict[str, asyncio.Task] = {}  # worker -> its liveness probe in flight
        self.loop_probe = LoopLagProbe()
        # a burst's submits and admissions, a slice per loop iteration: 256 of them landing
        # in one iteration (a submit pickles its request for Ray) stall the loop for tens of
        # ms; its first outputs come through the channel, already woken a slice at a time
        self.first_steps = IterationSlices(WAKE_SLICE)
        self._statuses = AnswerCache(STATUS_REUSE_S)  # statuses(): one round shared

    @property
    def index_ok(self) -> bool:
        """Whether the index answered the last read (False: routing by load alone)."""
        return self.liveness.index_ok

    async def candidates(self) -> Mapping[str, WorkerLoad]:
        return await self.liveness.candidates()

    async def live_epochs(self) -> dict[str, int]:
        """Live workers and their epochs from the index (see :class:`WorkerLiveness`)."""
        return await self.liveness.live_epochs()

    def mark_dead(self, worker_id: str) -> None:
        self.liveness.mark_dead(worker_id)
        # a worker replaced under the same name is another actor: look it up again
        self._handles.pop(worker_id, None)
        self._lookups.pop(worker_id, None)

    # -- calls -----------------------------------------------------------------------------

    async def _handle(self, worker_id: str) -> ray.actor.ActorHandle:
        """The worker's actor handle, cached; the first lookup (a blocking GCS round trip)
        runs in a thread, never on the loop, and the calls that need it meanwhile share it."""
        h = self._handles.get(worker_id)
        if h is not None:
            return h
        lookup = self._lookups.get(worker_id)
        if lookup is None:
            self.lookups += 1
            lookup = self._lookups[worker_id] = asyncio.ensure_future(self._lookup(worker_id))
        return await asyncio.shield(lookup)

    async def _lookup(self, worker_id: str) -> ray.actor.ActorHandle:
        try:
            h = await asyncio.to_thread(ray.get_actor, worker_id, namespace=self.namespace)
        except ValueError as exc:
            raise WorkerGone(f"no actor named {worker_id!r}: {exc}") from exc
        finally:
            self._lookups.pop(worker_id, None)  # a failed lookup is tried again next time
        self._handles[worker_id] = h
        return h

    async def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        handle = await self._handle(worker_id)
        ch = self.channels.get(worker_id, handle)
        inbox = ch.open(request.request_id, self.stream_interval)
        try:
            await self.first_steps.enter()
            # sent with the other requests of this loop turn for this worker, in one call
            admitted = await self._livecall_result(
                worker_id, self.submits.submit(ch, handle, request)
            )
            await self.first_steps.enter()
            yield admitted
            while True:
                while not await inbox.wait(self.timeouts.stream_stall_s):
                    await self._check_alive(worker_id, ch)
                item = inbox.take()
                if isinstance(item, RequestOutput):
                    yield item
                    if item.finished:
                        return
                elif isinstance(item, WorkerGone):
                    raise item
                else:  # a StreamEnd: the worker's engine stopped, the worker is going down
                    raise WorkerGone(str(item.error)) from item.error
        finally:
            ch.close(request.request_id)

    async def _livecall_result(self, worker_id: str, fut: asyncio.Future) -> Any:
        """A call's result, given up (WorkerGone) if the worker stops answering meanwhile
        (``fut`` is then cancelled)."""
        try:
            while not (await asyncio.wait({fut}, timeout=self.timeouts.stream_stall_s))[0]:
                await self._check_alive(worker_id, None)
            return fut.result()
        finally:
            if not fut.done():
                fut.cancel()

    async def _check_alive(self, worker_id: str, ch: WorkerChannel | None) -> None:
        """After a stall (nothing for this request for ``stream_stall_s``): a worker whose
        channel sent something meanwhile steps (the request waits its turn); else a worker
        that does not answer a probe is given up (a frozen process keeps its Ray connection
        open, so nothing else would end the wait)."""
        if ch is not None and time.monotonic() - ch.last_message < self.timeouts.stream_stall_s:
            return
        if not await self._answers(worker_id):
            raise self._stalled(worker_id)

    def _stalled(self, worker_id: str) -> WorkerGone:
        """A stream given up: no output for ``stream_stall_s`` and no answer to a probe."""
        self.stalls += 1
        return WorkerGone(
            f"worker {worker_id} stalled: no output for "
            f"{self.timeouts.stream_stall_s:g}s and no answer to a probe "
            f"within {self.timeouts.probe_timeout_s:g}s"
        )

    async def _answers(self, worker_id: str) -> bool:
        """Whether the worker's actor answers a ping in time (a frozen process does not);
        the streams waiting on one worker share one probe."""
        probe = self._probes.get(worker_id)
        if probe is None or probe.done():
            probe = self._probes[worker_id] = asyncio.ensure_future(self._ping(worker_id))
        return await asyncio.shield(probe)

    async def _call(self, worker_id: str, timeout_s: float, method: str, *args: Any) -> Any:
        """One actor call, the handle's first lookup included in its timeout (a slow GCS
        must not hold a probe, an abort or a status call past its deadline)."""

        async def call() -> Any:
            return await getattr(await self._handle(worker_id), method).remote(*args)

        return await asyncio.wait_for(call(), timeout_s)

    async def every_worker(self, method: str, *args: Any, timeout_s: float) -> dict[str, Any]:
        """``method(*args)`` on every worker Ray knows by name, in parallel: per worker its
        answer, or what it raised (a worker that did not answer in ``timeout_s``: a
        TimeoutError; a method's own error as Ray delivers it, its ``cause`` the original)."""
        names = sorted(await asyncio.to_thread(self.liveness.from_ray))
        calls = (self._call(n, timeout_s, method, *args) for n in names)
        results = await asyncio.gather(*calls, return_exceptions=True)
        return dict(zip(names, results, strict=True))

    async def _ping(self, worker_id: str) -> bool:
        try:
            await self._call(worker_id, self.timeouts.probe_timeout_s, "__ray_ready__")
        except (TimeoutError, *ACTOR_ERRORS, WorkerGone):
            return False
        return True

    async def abort(self, worker_id: str, request_id: str) -> None:
        try:
            await self._call(worker_id, self.call_timeout_s, "abort", request_id)
        except (TimeoutError, *ACTOR_ERRORS, WorkerGone):
            pass  # a dead worker's blocks are gone with it

    async def resync(self, worker_id: str, reason: str) -> bool:
        try:
            return bool(await self._call(worker_id, self.call_timeout_s, "resync_index", reason))
        except (TimeoutError, *ACTOR_ERRORS, WorkerGone):
            return False

    async def statuses(self) -> list[WorkerStatus]:
        """Every worker Ray knows by name, asked in parallel with a per-worker timeout: one
        that does not answer (frozen) or has no live heartbeat is listed as stale.

        Each answer costs a GCS listing, an index read and a call to every worker, and
        ``GET /metrics`` asks for it unauthenticated: callers at the same time share one
        round, and an answer serves for :data:`STATUS_REUSE_S`, so a flood of them costs
        the workers a few rounds a second, not one per call."""
        return list(await self._statuses.get(None, self._ask_statuses))

    async def _ask_statuses(self) -> list[WorkerStatus]:
        names = sorted(await asyncio.to_thread(self.liveness.from_ray))
        live = await self.liveness.from_index()
        results = await asyncio.gather(*(self._status(n) for n in names))
        now = time.monotonic()
        out = []
        for name, status in zip(names, results, strict=True):
            seen = self.liveness.last_seen(name)
            if status is None:
                epoch = live.get(name, (None,))[0] if live else None
                status = WorkerStatus(
                    name, epoch, 0, 0, 0, 0, 0, 0.0, index_healthy=False, stale=True
                )
            stale = status.stale or (live is not None and name not in live)
            out.append(
                replace(status, stale=stale, heartbeat_age_s=None if seen is None else now - seen)
            )
        return out

    async def _status(self, name: str) -> WorkerStatus | None:
        try:
            return await self._call(name, self.timeouts.status_timeout_s, "status")
        except (TimeoutError, *ACTOR_ERRORS, WorkerGone, GetTimeoutError) as exc:
            log.warning("worker %s did not answer a status call: %s", name, type(exc).__name__)
            return None
