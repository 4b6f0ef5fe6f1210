"""The router's serving path, protobuf-free: validate limits, route, stream, retry, abort.

``ServingCore.generate`` yields ``(worker_id, RequestOutput)`` pairs. A worker that dies
before the request produced any token is retried on another worker (transparently to the
client); one that dies after moves the request to another worker as a continuation (the
prompt plus the tokens already sent, :mod:`router.serving.migration`), up to
``migration_limit`` times, and the client's stream goes on; a request that cannot move
(``n > 1``, beams, structured outputs, no moves left) raises :class:`StreamBroken`.
Whatever ends the stream early (client cancel, deadline, error) aborts the request on the
worker, so no KV block is kept for a client that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence

from kvstore.blocks.hashing import HashContext
from kvstore.index_types import WorkerLoad
from kvstore.requests.errors import EngineOverloaded
from kvstore.requests.outputs import RequestOutput, relabelled
from kvstore.requests.protocol import Admitted, PullReport, WorkerRequest
from kvstore.requests.sampling_params import SamplingParams
from kvstore.runtime.pauses import WarmUpFreeze
from router.placement.adapters import for_tenant, resolve_adapter, serving
from router.placement.placement_types import NoWorkersError, RouteDecision, RouteRequest
from router.placement.prediction import PredictionTracker
from router.placement.router import Prepared, Router
from router.serving.cache_funnel import CacheFunnel
from router.serving.deciding import DecideThread
from router.serving.limits import ModelLimits, check_limits
from router.serving.migration import WORKER_DIED, Migration
from router.serving.outcomes import Outcomes
from router.serving.request_phases import RequestPhases
from router.serving.sent_work import SentWork
from router.serving.workers import WorkerDirectory, WorkerGone

log = logging.getLogger(__name__)


class StreamBroken(Exception):
    """The worker died after tokens had been sent; the client must retry the request."""


class ClusterOverloaded(Exception):
    """Every live worker's waiting queue is full (RESOURCE_EXHAUSTED); retry later."""


# Refused clients are told to come back in this long (Retry-After). Until then, or until one
# of this router's requests ends (a queue slot frees), a new request meets full queues too:
# the edges refuse it before parsing it (:meth:`ServingCore.check_room`), so a flood against
# full queues costs one parse per second, not one per request. (Another router's requests
# ending is not seen here: a slot it frees waits out the rest of the second.)
FULL_RETRY_S = 1


class ServingCore:
    """One router's request path. Routing decisions run on one thread (Router is not
    thread-safe and its Redis lookup is blocking), so the event loop never waits on Redis."""

    def __init__(
        self,
        router: Router,
        directory: WorkerDirectory,
        limits: ModelLimits,
        *,
        max_attempts: int = 3,
        migration_limit: int = 3,
        predictions: PredictionTracker | None = None,
    ) -> None:
        self.router = router
        # predicted vs realised cached tokens per worker; None: not compared
        self.predictions = predictions
        self.directory = directory
        self.limits = limits
        self.max_attempts = max_attempts
        self.migration_limit = migration_limit  # moves of one request after worker deaths
        self._decide = DecideThread(self._place_batch, self._unplace)
        self._background: set[asyncio.Task] = set()  # aborts sent to unresponsive workers
        self.retries = 0  # requests moved to another worker after a death before any token
        self.broken = 0  # streams ended because their worker died mid-stream
        self.migrations: dict[str, int] = {}  # reason -> streams moved to another worker
        self.overflows = 0  # attempts refused by a worker whose waiting queue was full
        self.own = SentWork()  # what this router sent, newer than any heartbeat
        self.funnel = CacheFunnel()  # where its prompts' cache hits were lost, stage by stage
        self.phases = RequestPhases()  # its requests by phase (where they wait)
        self.outcomes = Outcomes(router, directory, self.own, predictions, self.funnel)
        # when every live worker last refused a request for a full queue (None: since then
        # one of this router's admitted requests ended)
        self._full_at: float | None = None
        self._full_detail = ""  # the workers' refusals then: each names its limit
        self.live_requests = 0  # generate() calls not ended
        # the router actor's: freeze its heap once more, idle after its first requests
        self.warm_freeze: WarmUpFreeze | None = None

    def check_room(self) -> None:
        """Raise :class:`ClusterOverloaded` while the workers' queues are known to be full
        (see :data:`FULL_RETRY_S`); cheap, so the edges call it before parsing a request."""
        at = self._full_at
        if at is not None and time.monotonic() - at < FULL_RETRY_S:
            raise ClusterOverloaded(
                "not queued: every worker's queue was full moments ago (request refused "
                f"before it was read); retry later. {self._full_detail}"
            )

    def _place_batch(
        self, jobs: Sequence[tuple[RouteRequest, Mapping[str, WorkerLoad]]]
    ) -> list[RouteDecision | Exception]:
        """Requests placed together (decide thread): their index reads in one round trip,
        then each placed in arrival order."""
        out: list[RouteDecision | Exception] = []
        for (request, heartbeats), ready in zip(jobs, self.router.prepare(jobs), strict=True):
            if isinstance(ready, Exception):
                out.append(ready)
                continue
            try:
                out.append(self._place(request, heartbeats, ready))
            except Exception as exc:  # noqa: BLE001 - that request's error alone
                out.append(exc)
        return out

    def _place(
        self,
        request: RouteRequest,
        heartbeats: Mapping[str, WorkerLoad],
        prepared: Prepared | None = None,
    ) -> RouteDecision:
        """Route ``request`` and count it as this router's own work on the chosen worker, in
        one step (decide thread). Reading the loads and recording the placement together is
        what spreads a burst: requests that arrive together are decided one after another,
        each seeing its predecessors' placements even though no heartbeat shows them yet.
        (The decide thread is the only one that adds work, so the loads need not stay locked
        over the decision; the event loop only takes work away.)"""
        loads = self.own.loads(heartbeats)
        decision = self.router.route(request, loads, prepared)
        w = decision.worker_id
        load = loads.get(w)
        idle = load is not None and not (load.queued_prefill_tokens or load.running or load.waiting)
        uncached = len(request.token_ids) - decision.cached_tokens_expected
        self.own.placed(w, request.request_id, uncached, idle=idle)
        return decision

    def _unplace(self, job: tuple[RouteRequest, Mapping], decision: RouteDecision) -> None:
        """A placement whose request left while it was being decided: never used."""
        self.own.prefilled(decision.worker_id, job[0].request_id, done=True)
        self._settle(decision)

    def _settle(self, decision: RouteDecision) -> None:
        """End the placement's pending claim (on the decide thread, which owns the router)."""
        if decision.pending is None and decision.pull_ticket is None:
            return
        try:
            self._decide.call(self.router.settle, decision)
        except RuntimeError:  # shutting down: nothing routes any more
            pass

    def close(self) -> None:
        self._decide.close()

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        tenant: str | None = None,
        continue_from: Sequence[int] = (),
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        """``request_id`` is the client's label only: outputs carry it back, but on the
        workers the request runs under an id this router generates. Client ids are not
        unique across clients or tenants, so a reused one must never reach (or, by the abort
        in the cleanup below, stop) another client's request. ``tenant``: the caller's; an
        adapter registered for other tenants is unknown to it. ``continue_from``: output
        tokens the client already has (a stream resumed after its router died): the request
        continues after them, as a moved one does."""
        self.live_requests += 1
        phase: str | None = None
        try:
            check_limits(token_ids, params, self.limits)
            label, request_id = request_id, uuid.uuid4().hex
            lora_id = None
            if params.lora is not None:
                lora_id = resolve_adapter(
                    params.lora, for_tenant(await self.directory.candidates(), tenant)
                )
            ctx = HashContext(self.limits.model_id, lora_id, params.cache_salt)
            excluded: set[str] = set()
            full: list[str] = []  # workers that refused the request: waiting queue full
            loop = asyncio.get_running_loop()
            migration = Migration(token_ids, params, self.migration_limit)
            if continue_from:
                migration.resume(continue_from, self.limits.vocab_size)
            attempt = 0
            while attempt < self.max_attempts:
                attempt += 1
                candidates = {
                    w: load
                    for w, load in serving(
                        lora_id, for_tenant(await self.directory.candidates(), tenant)
                    ).items()
                    if w not in excluded
                }
                if not candidates:
                    if full:  # (the base model's candidates: every live worker, all tried)
                        raise self._overloaded(label, full, every_worker=lora_id is None)
                    raise NoWorkersError(
                        f"no live worker for request {label!r}"
                        + (f" (tried {sorted(excluded)})" if excluded else "")
                    )
                prompt, attempt_params, continued = migration.attempt()
                route_req = RouteRequest(request_id, prompt, ctx)
                phase = self.phases.move(phase, "routing")
                decision = await self._decide.place(route_req, candidates)
                phase = self.phases.move(phase, "submitting")
                worker = decision.worker_id
                produced = finished = gone = admitted = False
                pulled: PullReport | None = None
                sent = loop.time()
                wreq = WorkerRequest(
                    request_id,
                    prompt,
                    attempt_params,
                    bool(decision.keys),
                    decision.pull,
                    continued,
                )
                try:
                    async for item in self.directory.stream(worker, wreq):
                        if isinstance(item, Admitted):
                            admitted = True
                            phase = self.phases.move(phase, "first_token")
                            if decision.keys:
                                self.router.check_parity(request_id, decision.keys, item.last_key)
                            pulled = item.pulled
                            if pulled is not None:
                                self.outcomes.pull(decision, pulled)
                                self._decide.call(self.router.pull_reported, decision, pulled)
                            continue
                        if not produced and any(d.token_ids for d in item.outputs):
                            produced = True
                            phase = self.phases.move(phase, "streaming")
                            self.own.prefilled(worker, request_id, done=False)
                            self._settle(decision)
                            self.outcomes.first_output(decision, item, pulled)
                            if pulled is not None:
                                cached = item.usage.cached_tokens
                                self._decide.call(self.router.pull_used, decision, pulled, cached)
                            ttft_s = loop.time() - sent
                            self.outcomes.prefill(request_id, item, ttft_s, pulled)
                        finished = item.finished
                        yield worker, relabelled(migration.passed(item), label)
                    return
                except WorkerGone as exc:
                    gone = True
                    self.directory.mark_dead(worker)
                    excluded.add(worker)
                    if produced and migration.can_move():
                        migration.moved()
                        self.migrations[WORKER_DIED] = self.migrations.get(WORKER_DIED, 0) + 1
                        attempt = 0  # the continuation's own attempts
                        log.warning(
                            "worker %s died while streaming request %s: continuing it "
                            "elsewhere after its %d tokens (move %d of %d)",
                            worker,
                            label,
                            len(migration.sent),
                            migration.moves,
                            migration.limit,
                        )
                    elif produced:
                        self.broken += 1
                        raise StreamBroken(
                            f"worker {worker} died while streaming request {label!r}: {exc}; "
                            "the partial output is lost, retry the request"
                        ) from exc
                    else:
                        self.retries += 1
                        log.warning(
                            "worker %s died before request %s produced a token (attempt %d): "
                            "retrying elsewhere",
                            worker,
                            label,
                            attempt,
                        )
                except EngineOverloaded as exc:  # nothing was queued: try a worker with room
                    excluded.add(worker)
                    full.append(f"{worker} ({exc})")
                    self.overflows += 1
                finally:
                    self.own.prefilled(worker, request_id, done=True)
                    if not produced:  # settled at its first token otherwise
                        self._settle(decision)
                    if admitted:  # it leaves a queue slot behind
                        self._full_at = None
                    if not finished and gone:
                        # a frozen worker would hold the retry for the abort's whole timeout; the
                        # abort still reaches it if it thaws
                        task = asyncio.create_task(self._abort_quietly(worker, request_id))
                        self._background.add(task)
                        task.add_done_callback(self._background.discard)
                    elif not finished:
                        # client gone, deadline, error or death: never leave blocks behind
                        await asyncio.shield(self._abort_quietly(worker, request_id))
            if full:
                raise self._overloaded(label, full, every_worker=False)
            raise NoWorkersError(f"request {label!r}: {self.max_attempts} workers died in turn")
        finally:
            self.phases.move(phase, None)
            self.live_requests -= 1
            if self.warm_freeze is not None:
                self.warm_freeze.request_ended(idle=not self.live_requests)

    def _overloaded(
        self, request_id: str, full: list[str], *, every_worker: bool
    ) -> ClusterOverloaded:
        if every_worker:  # whatever the next request is, it meets full queues
            self._full_at = time.monotonic()
            self._full_detail = "; ".join(full)
        return ClusterOverloaded(
            f"request {request_id!r} not queued: every worker tried has a "
            f"full queue; retry later. " + "; ".join(full)
        )

    async def _abort_quietly(self, worker: str, request_id: str) -> None:
        try:
            await self.directory.abort(worker, request_id)
        except Exception as exc:  # the worker may be dead; its blocks died with it
            log.debug("abort of %s on %s failed: %s", request_id, worker, exc)
