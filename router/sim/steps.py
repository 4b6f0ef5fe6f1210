"""The simulated worker's engine step: chunked-prefill steps, decode fast-forward,
admission (a real KV allocation with its prefix hit), completion.

Every step first decodes one token for each running sequence, then spends the rest of the
token budget on prefill chunks, FCFS (sequences already admitted first, then new admissions);
its time is the :class:`~router.sim.config.TimeModel`'s. :class:`SimSteps` is mixed into
:class:`~router.sim.worker.SimWorker`, which owns the state named below.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvstore.blocks.events import BlockStored, KVEvent
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from router.sim.config import TimeModel
from router.sim.records import ActiveRequest
from worker.kv import KVCacheManager, KVCapacityError

ParityHook = Callable[[str, Sequence[BlockKey], Sequence[BlockKey]], object]


class SimSteps:
    """Steps, admission and completion of a simulated worker (state set up by
    ``SimWorker.__init__``; see its comments)."""

    kv: KVCacheManager
    tm: TimeModel
    parity: ParityHook | None
    clock: float
    waiting: deque[ActiveRequest]
    prefilling: deque[ActiveRequest]
    decoding: list[ActiveRequest]
    queued_prefill: int
    waiting_cached: int
    decode_ctx: int
    computed_prefill_tokens: int
    busy_s: float
    max_loras: int
    lora_loads: int
    _events: list[tuple[float, list[KVEvent]]]
    _step_events: list[KVEvent]
    _blocked: bool
    _step_prefill: int
    _loras: OrderedDict[str, None]
    _load_s: float

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
        hosted = alloc.num_host_tokens
        active.rec.tier_cached_tokens = {Tier.HOST: hosted} if hosted else {}
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
