"""A simulated worker: a real KVCacheManager plus a step-level time model
(:class:`~router.sim.config.TimeModel`).

The engine is modelled as continuous batching with chunked prefill: every step first
decodes one token for each running sequence, then spends the rest of the token budget on
prefill chunks, FCFS (sequences already admitted first, then new admissions). A sequence
is admitted (its KV slots allocated, its prefix-cache hit taken, its full blocks cached and
published) when it gets its first chunk; a prompt that does not fit waits at the head of
the queue. Decode tokens occupy no KV blocks here (only prompts are cached). Steps that
only decode are fast-forwarded in one go up to the next event, so a full trace replays in
seconds of Python per worker.

Departures from ``worker/engine/scheduler.py``, and why they do not move the figures: the
engine allocates a prompt's blocks chunk by chunk and defers an admission whose prefix hit
includes a block written in the same step; here the whole prompt is allocated at admission.
Under FCFS with chunks as large as the budget, a request is admitted only in the step that
schedules the last chunk of every prefill ahead of it, so the only case that differs is a
same-step sharer (it starts one step early here): 0 admissions on the conversation trace,
1 of ~2,800 on the shared-prefix workload (8 workers, seed 0). No preemption, no admission
watermark (the cache never fills with running sequences at the benchmark's sizes).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvstore.blocks.events import BlockStored, KVEvent
from kvstore.blocks.hashing import BlockKey, HashContext
from kvstore.blocks.tiers import Tier
from kvstore.index_types import WorkerLoad
from router.sim.config import TimeModel
from router.sim.records import ActiveRequest, RequestRecord, SimRequest
from worker.kv import KVCacheManager, KVCapacityError
from worker.kv.transfer import KVLayout, RunHeader

ParityHook = Callable[[str, Sequence[BlockKey], Sequence[BlockKey]], object]


class SimWorker:
    """One worker: FCFS queue, chunked-prefill steps, admission (a real KV allocation with its
    prefix hit) and completion, a real KV manager emitting events."""

    def __init__(
        self,
        worker_id: str,
        kv: KVCacheManager,
        time_model: TimeModel,
        *,
        parity: ParityHook | None = None,
        waiting_load: str = "uncached",
        max_loras: int = 8,
    ) -> None:
        if waiting_load not in ("uncached", "whole"):
            raise ValueError(f"waiting_load must be 'uncached' or 'whole', got {waiting_load!r}")
        self.worker_id = worker_id
        self.kv = kv
        self.tm = time_model
        self.parity = parity  # called at admission with (request id, router keys, our keys)
        self.waiting_load = waiting_load  # see SimConfig.waiting_load
        # each lower tier's size, as a real worker's heartbeat names them (the router prices
        # a hit by the tier holding it only on workers that have that tier)
        self._tier_blocks = {b.tier: b.num_blocks for b in kv.tiers.backends}
        self.clock = 0.0  # end of the last simulated step
        self.waiting: deque[ActiveRequest] = deque()
        self.prefilling: deque[ActiveRequest] = deque()
        self.decoding: list[ActiveRequest] = []
        self.queued_prefill = 0  # uncached prompt tokens still to compute (waiting + admitted)
        self.waiting_cached = 0  # prompt tokens of waiting requests their prefix hit will skip
        self.decode_ctx = 0  # sum of KV lengths of decoding sequences
        self.computed_prefill_tokens = 0  # prompt tokens this worker actually computed
        self.busy_s = 0.0  # time spent in steps
        self._events: list[tuple[float, list[KVEvent]]] = []  # (publish time, batch)
        self._step_events: list[KVEvent] = []
        self._blocked = False  # head of the queue did not fit; retry after a sequence ends
        self._step_prefill = 0  # prompt tokens computed by the last simulated step
        self.max_loras = max_loras
        self._loras: OrderedDict[str, None] = OrderedDict()  # adapters in slots, LRU first
        self.lora_loads = 0  # adapters loaded into a slot (reloads after eviction count)
        self._load_s = 0.0  # this step's lower-tier loads, pull copies and LoRA loads (s)
        # requests whose pull is in flight: (ready time, order, request, run or None), as a
        # real worker holds them before queueing; their uncached tokens count as queued
        self.pulling: list[tuple[float, int, ActiveRequest, RunHeader | None]] = []
        self._pull_order = 0
        self._landing: dict[BlockKey, float] = {}  # last key of a pulled run -> when it lands

    # ---- interface used by the replay loop -------------------------------------------------

    def submit(
        self,
        req: SimRequest,
        expected_cached: int,
        keys: Sequence[BlockKey],
        pull: tuple[float, RunHeader | None] | None = None,
    ) -> RequestRecord:
        """Queue a request that arrived at ``req.arrival_s`` (the worker is advanced to it);
        the returned record fills in as the request runs. ``pull``: (when its pull ends,
        the run it brings or None): the request is queued only then, after the import."""
        rec = RequestRecord(
            req.request_id,
            self.worker_id,
            req.arrival_s,
            len(req.token_ids),
            req.output_len,
            expected_cached,
        )
        active = ActiveRequest(req, rec, keys)
        if pull is None and self._landing:
            # a pull in flight brings this prompt's prefix: queue behind it, as the worker
            # does, rather than compute the prefix alongside the import
            ready = max((self._landing.get(k, -math.inf) for k in keys), default=-math.inf)
            if ready > self.clock:
                pull = (ready, None)
        if pull is not None:
            if pull[1] is not None and pull[1].keys:
                last = pull[1].keys[-1]
                self._landing[last] = max(self._landing.get(last, -math.inf), pull[0])
            active.est_new = len(req.token_ids) - expected_cached
            self.queued_prefill += active.est_new
            heapq.heappush(self.pulling, (pull[0], self._pull_order, active, pull[1]))
            self._pull_order += 1
            return rec
        self._enqueue(active)
        return rec

    def export_run(
        self, keys: Sequence[BlockKey], start: int, ctx: HashContext
    ) -> RunHeader | None:
        """What a peer pulling ``keys`` (blocks ``start..``) gets from this worker; reading
        them out is charged to its next step."""
        pin = self.kv.pin_export(keys, ctx, start)
        self.kv.release_export(pin)
        if not pin.keys:
            return None
        self._load_s += len(pin) * self.kv.block_size * self.tm.pull_copy_s_per_token
        layout = KVLayout(self.kv.block_size, 0, 0, 0, "sim")
        return RunHeader(layout, ctx, start, tuple(pin.keys), tuple(pin.token_ids))

    def _release_pulls(self, now: float) -> None:
        """Import the runs of pulls that ended by ``now`` and queue their requests."""
        while self.pulling and self.pulling[0][0] <= now:
            _, _, active, header = heapq.heappop(self.pulling)
            self.queued_prefill -= active.est_new
            req = active.req
            if header is not None:
                if self._landing.get(header.keys[-1], math.inf) <= now:
                    del self._landing[header.keys[-1]]
                plan = self.kv.plan_import(req.token_ids, req.ctx, header)
                self.kv.commit_import(plan)
                n = len(plan) * self.kv.block_size
                active.rec.pulled_tokens = n
                self._load_s += n * self.tm.pull_copy_s_per_token
                self._step_events.extend(self.kv.drain_events())
            self._enqueue(active)

    def _enqueue(self, active: ActiveRequest) -> None:
        req = active.req
        # As the engine's scheduler does: what its KV manager would hit now, or a request
        # queued ahead of it will have cached by its turn (a pure query).
        hint, active.claim = self.kv.expected_prefix(req.token_ids, req.ctx, self.kv.claims)
        self.kv.claim(active.claim)  # evicted last while it waits (as the engine)
        active.est_new = len(req.token_ids) - hint
        self.queued_prefill += active.est_new
        self.waiting_cached += len(req.token_ids) - active.est_new
        self.waiting.append(active)
        self.clock = max(self.clock, req.arrival_s)

    def load(self, now: float) -> WorkerLoad:
        """The heartbeat a real engine would send at ``now``: a step still in flight at
        ``now`` (the simulation has already run it) still counts its prefill as queued;
        waiting requests count as ``waiting_load`` says (uncached tail or whole prompt)."""
        inflight = self._step_prefill if self.clock > now else 0
        queued = self.queued_prefill + inflight
        if self.waiting_load == "whole":
            queued += self.waiting_cached
        return WorkerLoad(
            running=len(self.prefilling) + len(self.decoding),
            waiting=len(self.waiting),
            free_blocks=self.kv.num_free_blocks(),
            waiting_pinned_blocks=self.kv.num_evictable_of(self.kv.claims) if self.waiting else 0,
            total_blocks=self.kv.num_blocks,
            queued_prefill_tokens=queued,
            decode_tokens=len(self.decoding),
            lora_loaded=tuple(self._loras),
            tier_blocks=self._tier_blocks,
        )

    def take_events(self) -> list[tuple[float, list[KVEvent]]]:
        """KV event batches published since the last call, with their publish times."""
        out, self._events = self._events, []
        return out

    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding or self.pulling)

    def advance(self, until: float) -> None:
        """Run every step that starts before ``until`` (a step in flight finishes after it)."""
        while self.clock < until:
            self._release_pulls(self.clock)
            if not (self.waiting or self.prefilling or self.decoding):
                if not self.pulling or self.pulling[0][0] >= until:
                    self.clock = until
                    return
                self.clock = self.pulling[0][0]  # idle until the next pull lands
                continue
            if self.prefilling or (self.waiting and not self._blocked):
                self._step()
            elif self.decoding:  # (a landing pull ends a fast-forward: it may admit)
                self._fast_forward(min(until, self.pulling[0][0]) if self.pulling else until)
            else:  # blocked with nothing running: the head can never fit
                self._reject(self._pop_waiting())

    # ---- the engine step -------------------------------------------------------------------

    def _step(self) -> None:
        tm = self.tm
        budget = tm.max_batched_tokens - len(self.decoding)
        self._step_prefill = 0
        busy = tm.step_overhead_s + tm.decode_s_per_ctx_token * self.decode_ctx
        done: list[ActiveRequest] = []
        for active in self.prefilling:
            if budget <= 0:
                break
            busy, budget = self._chunk(active, budget, busy, done)
        while budget > 0 and self.waiting and self._running() < tm.max_running:
            admitted = self._admit(self.waiting[0])
            if admitted is False:
                break  # does not fit now: FCFS, wait for a sequence to finish
            active = self._pop_waiting()
            if admitted is None:
                self._reject(active)
                continue
            self.prefilling.append(active)
            busy, budget = self._chunk(active, budget, busy, done)
        busy += self._load_s
        self._load_s = 0.0
        end = self.clock + busy
        self._decode_steps(1, end)
        for active in done:
            self.prefilling.remove(active)
            active.rec.first_token_s = end
            active.decode_left = active.req.output_len - 1
            if active.decode_left <= 0:
                self._finish(active, end)
            else:
                active.ctx_len = len(active.req.token_ids) + 1
                self.decode_ctx += active.ctx_len
                self.decoding.append(active)
        self._end_step(end, busy)

    def _chunk(
        self, active: ActiveRequest, budget: int, busy: float, done: list[ActiveRequest]
    ) -> tuple[float, int]:
        n = min(len(active.req.token_ids) - active.pos, budget)
        self._step_prefill += n
        busy += self.tm.prefill_s(active.pos, n)
        active.pos += n
        self.queued_prefill -= n
        self.computed_prefill_tokens += n
        if active.pos == len(active.req.token_ids):
            done.append(active)
        return busy, budget - n

    def _fast_forward(self, until: float) -> None:
        """k decode-only steps at once: up to the next finish or past ``until``."""
        tm = self.tm
        n = len(self.decoding)
        self._step_prefill = 0
        k = min(a.decode_left for a in self.decoding)
        first = tm.step_overhead_s + tm.decode_s_per_ctx_token * self.decode_ctx
        if until != math.inf:
            k = min(k, max(1, math.ceil((until - self.clock) / first)))
        busy = k * first + tm.decode_s_per_ctx_token * n * k * (k - 1) / 2
        end = self.clock + busy
        self._decode_steps(k, end)
        self._end_step(end, busy)

    def _decode_steps(self, k: int, end: float) -> None:
        if not self.decoding:
            return
        still: list[ActiveRequest] = []
        for active in self.decoding:
            active.decode_left -= k
            active.ctx_len += k
            self.decode_ctx += k
            if active.decode_left <= 0:
                self.decode_ctx -= active.ctx_len
                self._finish(active, end)
            else:
                still.append(active)
        self.decoding = still

    def _end_step(self, end: float, busy: float) -> None:
        self.clock = end
        self.busy_s += busy
        self.kv.take_transfers()  # no tensors here: the copies' time is in the step already
        self._step_events.extend(self.kv.drain_events())
        if self._step_events:
            self._events.append((end, self._step_events))
            self._step_events = []

    def _pop_waiting(self) -> ActiveRequest:
        active = self.waiting.popleft()
        self.waiting_cached -= len(active.req.token_ids) - active.est_new
        self.kv.unclaim(active.claim)
        active.claim = []
        return active

    def _running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    # ---- admission, completion -------------------------------------------------------------

    def _admit(self, active: ActiveRequest) -> bool | None:
        """Allocate the prompt's slots: True, False (not now), None (can never fit)."""
        req = active.req
        hit = self.kv.lookup_prefix(req.token_ids, req.ctx)
        try:
            alloc = self.kv.allocate_slots(
                req.request_id,
                req.token_ids,
                len(req.token_ids) - hit.num_tokens,
                ctx=req.ctx,
                prefix=hit,
            )
        except KVCapacityError:
            return None
        if alloc is None:
            self._blocked = True
            return False
        assert alloc.num_cached_tokens == hit.num_tokens, "lookup and allocation disagree"
        active.pos = alloc.num_cached_tokens
        active.rec.cached_tokens = alloc.num_cached_tokens
        lower = {
            Tier.HOST: alloc.num_host_tokens,
            Tier.DISK: alloc.num_lower_tokens - alloc.num_host_tokens,  # below the host: disk
        }
        active.rec.tier_cached_tokens = {t: n for t, n in lower.items() if n}
        self._load_s += self.tm.load_s(active.rec.tier_cached_tokens)
        self._use_lora(req.ctx.lora_id)
        self.queued_prefill += len(req.token_ids) - alloc.num_cached_tokens - active.est_new
        events = self.kv.drain_events()
        self._step_events.extend(events)
        if self.parity is not None and active.keys:
            self._check_parity(active, hit.keys, events)
        return True

    def _use_lora(self, lora_id: str | None) -> None:
        """Put the adapter in a slot (LRU eviction; a running adapter's slot is not pinned
        here, a simplification) and charge the load to this step."""
        if lora_id is None:
            return
        if lora_id in self._loras:
            self._loras.move_to_end(lora_id)
            return
        if len(self._loras) >= self.max_loras:
            self._loras.popitem(last=False)
        self._loras[lora_id] = None
        self._load_s += self.tm.lora_load_s
        self.lora_loads += 1

    def _check_parity(
        self, active: ActiveRequest, hit_keys: Sequence[BlockKey], events: list[KVEvent]
    ) -> None:
        """Compare the router's last key with the last of the chain this allocation hit +
        stored. Only a contiguous chain names the prompt's last block: when a block was
        already cached under another block (so not re-stored), the chain has a gap and the
        check is skipped.
        """
        chain = list(hit_keys)
        for event in events:
            if isinstance(event, BlockStored):
                chain.extend(event.keys)
        if len(chain) == len(active.req.token_ids) // self.kv.block_size:
            assert self.parity is not None
            self.parity(active.req.request_id, active.keys, chain[-1])

    def _finish(self, active: ActiveRequest, end: float) -> None:
        active.rec.finish_s = end
        self.kv.free(active.req.request_id)
        self._blocked = False

    def _reject(self, active: ActiveRequest) -> None:
        active.rec.rejected = True
        self.queued_prefill -= active.est_new
