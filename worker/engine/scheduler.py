"""Continuous-batching scheduler: token budget, chunked prefill, admission, preemption.

Each step gets a budget of ``max_num_batched_tokens`` tokens and is filled in three passes:

1. decodes of running sequences (one token each), in policy order;
2. prefill work of running requests (chunks of long prompts, recomputation after preemption,
   forked samples whose blocks were freed), at most ``prefill_chunk_cap`` tokens per
   sequence;
3. admission of waiting requests, in policy order, while the budget, ``max_num_seqs`` and the
   KV cache allow (a prefix hit counts: only the uncached tail needs blocks). The first waiting
   request that does not fit stops admission (no starvation of long prompts); no admission
   happens in a step that had to preempt. With ``cache_aware_admission`` the leading
   waiting requests of one policy class go longest cached prefix first, within a starvation
   bound (``admission.py``).

Work is scheduled per sequence; every sequence's allocation goes through the KV manager,
which either succeeds or leaves the pool unchanged. When a running request cannot grow, the
scheduler preempts a victim, its KV swapped to the host tier or dropped for recompute: the
policy it holds (:class:`~worker.engine.preemption.Preemption`) chooses and carries it out.

Two rules keep the KV cache honest, because a block is registered in the prefix cache when
it is allocated, before the forward pass writes its KV:

* a request that already got blocks in this step is never freed in this step (it is not a
  preemption victim, and a request that cannot fit even alone is finished *after* the step);
* a sequence whose prefix hit includes a block being written in this step waits for the next
  step (then the whole hit is usable): a burst of requests sharing a system prompt computes it
  once, one step later, instead of once per request.

After the model, the scheduler applies what the output processor decided
(:meth:`Scheduler.update_from_output`): it appends the tokens, forks
and prunes beams (and forks the parallel samples of a prompt, :meth:`Scheduler.fork_samples`)
with copy-on-write blocks, gives back the blocks of every finished sequence at once, and
finishes requests; the engine collects them with :meth:`Scheduler.take_finished`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence as Seq
from typing import Literal

from kvstore.requests.outputs import FinishReason
from worker.engine.admission import CacheAwareOrder
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import OutputText
from worker.engine.forking import advance_beams, fork_samples
from worker.engine.outcome import RequestOutcome
from worker.engine.policy import SchedulingPolicy
from worker.engine.preemption import Preemption
from worker.engine.request import Request, RequestStatus, Sequence
from worker.engine.sched_output import ScheduledChunk, SchedulerOutput
from worker.engine.speculator import Speculator
from worker.engine.waiting import WaitingQueue
from worker.kv import BlockKey, KVCacheManager, KVCapacityError, PrefixHit

Outcome = Literal["ok", "wait", "defer"]  # scheduled / cannot now / its prefix is being written


class Scheduler:
    """Decides, step by step, which tokens of which sequences run, and applies what the model
    produced (preempting through the :class:`~worker.engine.preemption.Preemption` it holds)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self.speculator = speculator  # drafts for decodes (speculative decoding), if on
        self.kv = kv
        self.policy = policy
        self.waiting = WaitingQueue(kv, policy)  # new and preempted requests, their claims
        self.running: list[Request] = []
        self.preemption = Preemption(config, kv, policy, self.waiting, self.free_seq)
        self._watermark = math.ceil(config.admission_watermark * kv.num_blocks)
        cfg = config
        self._order = (
            CacheAwareOrder(kv, policy, cfg.admission_max_overtakes, cfg.admission_max_wait_s)
            if cfg.cache_aware_admission
            else None
        )
        # per-step state
        self._budget = 0
        self._touched: set[str] = set()  # requests that got blocks in this step
        self._writing: set[int] = set()  # blocks whose KV is written in this step
        self._out = SchedulerOutput.make_empty()
        self._drafted: list[Sequence] = []  # sequences given drafts in this step
        self._finished: list[Request] = []  # finished or aborted, not yet taken by the engine
        # the last admission pass: waiting requests by reason, and how many it saw waiting
        self._wait_reasons: dict[str, int] = {}
        self._wait_counted = 0
        self._wait_why = "kv_blocks"  # why the candidate being scheduled must wait

    # ---- queues --------------------------------------------------------------------------

    def add(self, req: Request, prompt_keys: Seq[BlockKey] | None = None) -> None:
        """Queue ``req`` (new or preempted); see :meth:`WaitingQueue.add`."""
        self.waiting.add(req, prompt_keys)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and free all its blocks (abort / finish)."""
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.discard(req)
        self.free_blocks(req)

    def free_blocks(self, req: Request) -> None:
        for seq in (*req.seqs, *req.done_seqs):
            self.free_seq(seq)

    def free_seq(self, seq: Sequence, *, offload: bool = True) -> None:
        if seq.allocated:
            self.kv.free(seq.seq_id, offload=offload)
        seq.reset_for_recompute()

    def pending_prefill_tokens(self) -> int:
        """Tokens still to prefill, what a router compares against a recompute elsewhere:
        the unfinished prefills (chunked or recomputed) of running requests, and each waiting
        sequence less its leading blocks that are cached or claimed by a sequence queued
        ahead of it (:meth:`WaitingQueue.pending_tokens`)."""
        waiting = self.waiting.pending_tokens()
        running = sum(s.num_remaining for r in self.running for s in r.seqs if s.num_remaining > 1)
        return waiting + running

    def num_decoding_seqs(self) -> int:
        """Running sequences with one token left to compute: the next step's decodes."""
        return sum(1 for r in self.running for s in r.seqs if s.num_remaining <= 1)

    def waiting_by_reason(self) -> dict[str, int]:
        """The waiting requests by why the last admission pass left them waiting, and
        ``"new"``: those queued since (:data:`~kvstore.requests.protocol.WAIT_REASONS`).
        Requests aborted since that pass still count until the next one."""
        new = len(self.waiting) - self._wait_counted
        return {**self._wait_reasons, "new": new} if new > 0 else self._wait_reasons

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seq_slots for r in self.running)

    # ---- the step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        for seq in self._drafted:  # a step that failed before its outcomes were applied
            if seq.allocated:
                self.kv.settle_drafts(seq.seq_id, seq.token_ids, seq.num_computed)
        self._drafted.clear()
        self._out = out = SchedulerOutput.make_empty()
        self._budget = self.config.max_num_batched_tokens
        self._touched.clear()
        self._writing.clear()
        by_key = sorted(self.running, key=self.policy.key)
        # pass 1: decodes; pass 2: the prefill work of the requests pass 1 saw with some
        # (a sequence that is no decode in pass 1 is none in pass 2, unless its request was
        # preempted or doomed meanwhile, and those are skipped)
        prefilling = []
        running = RequestStatus.RUNNING
        spec = self.speculator
        if spec is not None:
            spec.begin_step()
            num_decoding = self.num_decoding_seqs()
            # drafts take the step's token budget before prefills: while prompts are to be
            # computed (a running request's, or a waiting one the batch has room for), the
            # step goes to them, whose tokens all count, not to drafts worth their acceptance
            if self.num_running_seqs > num_decoding or (
                self.waiting and self.num_running_seqs < self.config.max_num_seqs
            ):
                spec.plain_step(num_decoding)
                spec = None
            elif not spec.speculating(num_decoding):
                spec = None
        for req in by_key:
            if req.status is not running or req.doomed:
                continue  # preempted earlier in this step
            seqs = req.seqs
            if len(seqs) == 1:  # n == 1: the usual request, without _work's list
                seq = seqs[0]
                remaining = len(seq.token_ids) - seq.num_computed
                if remaining <= 0 or seq.pending_logits is not None:
                    continue
                if remaining == 1 and seq.allocated:
                    if self._budget and self._schedule_seq(req, seq, admit=False) == "ok":
                        if spec is not None and self._budget:
                            self._add_drafts(spec, req, seq, num_decoding)
                else:
                    prefilling.append(req)
                continue
            has_prefill = False
            for seq in _work(req):
                if not (seq.allocated and seq.num_remaining == 1):
                    has_prefill = True
                    continue
                outcome = self._schedule_seq(req, seq, admit=False) if self._budget else "wait"
                if outcome == "wait":
                    has_prefill = True  # (what pass 2 finds: it checks each sequence again)
                    break
            if has_prefill:
                prefilling.append(req)
        for req in prefilling:
            if req.status is not running or req.doomed:
                continue
            for seq in _work(req):
                if seq.allocated and seq.num_remaining == 1:
                    continue
                outcome = self._schedule_seq(req, seq, admit=False) if self._budget else "wait"
                if outcome == "wait":
                    break
        if not out.preempted and self.waiting:
            self._admit_waiting()
        elif self._wait_counted or self.waiting:  # preempting: nobody is admitted
            n = self._wait_counted = len(self.waiting)
            self._wait_reasons = {"kv_blocks": n} if n else {}
        out.transfers = self.kv.take_transfers()
        out.blocks_to_copy = self.kv.take_copies()
        return out

    def _admit_waiting(self) -> None:
        out = self._out
        # LoRA adapters of running requests: each holds a device slot while it runs
        adapters = {r.params.lora for r in self.running if r.params.lora is not None}
        seq_slots = self.num_running_seqs  # kept up to date below: once, not per candidate
        waiting = order = list(self.waiting)
        now = time.monotonic()
        if self._order is not None:
            order = self._order.order(waiting, now)
        deferred: list[Request] = []  # and admitted, in this pass: whom the bound protects
        admitted: list[Request] = []
        passed: dict[str, int] = {}  # requests left waiting while later ones may go, by reason
        stop = "kv_blocks"  # why the pass stopped (the requests from there on wait for it)
        for req in order:
            if self._budget == 0:
                stop = "budget"
                break
            if self._order is not None and not self._order.may_pass(req, deferred, admitted, now):
                passed["order"] = passed.get("order", 0) + 1
                continue  # it would pass a deferred request at its bound
            if req.awaiting_grammar:
                passed["grammar"] = passed.get("grammar", 0) + 1
                continue  # its grammar is compiling: let the others pass
            if seq_slots + req.num_seq_slots > self.config.max_num_seqs:
                stop = "max_num_seqs"
                break
            lora = req.params.lora
            if lora is not None and lora not in adapters:
                if len(adapters) >= self.config.max_loras:
                    passed["lora"] = passed.get("lora", 0) + 1
                    continue  # every slot is in use: wait for one, let others pass
            outcome: Outcome = "wait"
            self._wait_why = "kv_blocks"
            for seq in _work(req):
                if not self._budget:
                    outcome, self._wait_why = "wait", "budget"
                    break
                outcome = self._schedule_seq(req, seq, admit=True)
                if outcome != "ok":
                    break
            if req.request_id not in self._touched:
                if outcome == "defer":
                    deferred.append(req)
                    passed["deferred"] = passed.get("deferred", 0) + 1
                    continue  # its prefix is being computed right now: admit it next step
                stop = self._wait_why
                break  # the head of the queue does not fit: wait (no overtaking)
            self.waiting.admit(req)
            if lora is not None:
                adapters.add(lora)
            self.running.append(req)
            seq_slots += req.num_seq_slots
            out.admitted.append(req.request_id)
            admitted.append(req)
            if req.status is RequestStatus.PREEMPTED:
                req.protected = True
                out.resumed.append(req.request_id)
            req.status = RequestStatus.RUNNING
            if req.admitted_time is None:
                req.admitted_time = now
        if self._order is not None and out.admitted:
            self._order.note_admitted(waiting, set(out.admitted))
        self._wait_counted = left = len(waiting) - len(admitted)
        stopped = left - sum(passed.values())
        if stopped:
            passed[stop] = passed.get(stop, 0) + stopped
        self._wait_reasons = passed

    def _schedule_seq(self, req: Request, seq: Sequence, *, admit: bool) -> Outcome:
        """Allocate and schedule this step's tokens of ``seq``, or say why not."""
        cfg = self.config
        while True:
            hit = None
            if not seq.allocated:
                hit = (
                    self.kv.lookup_prefix(seq.token_ids, req.ctx, seq.claim)
                    if req.prompt_logprobs is None
                    else PrefixHit.empty(req.ctx)  # every prompt position is computed
                )
                seq.cached_hint = hit.num_tokens
                if any(b in self._writing for b in hit.block_ids):
                    return "defer"
            computed = hit.num_tokens if hit is not None else seq.num_computed
            remaining = len(seq.token_ids) - computed
            n = min(remaining, self._budget)
            if remaining > 1:
                n = min(n, cfg.prefill_chunk_cap)
                if n < remaining and not cfg.enable_chunked_prefill:
                    self._wait_why = "budget"
                    return "wait"
            if (
                admit
                and not seq.allocated
                and self.running
                and not self._fits_watermark(seq, computed + n, hit)
            ):
                return "wait"
            try:
                alloc = self.kv.allocate_slots(
                    seq.seq_id,
                    seq.token_ids,
                    n,
                    ctx=req.ctx if hit is not None else None,
                    prefix=hit,
                )
            except KVCapacityError:
                self._doom(req)
                return "wait"
            if alloc is not None:
                break
            if admit or not self._make_room(req):
                return "wait"
        if hit is not None:
            assert alloc.num_cached_tokens == hit.num_tokens, "prefix hit changed before adoption"
            seq.allocated = True
            seq.num_computed = hit.num_tokens
            if req.num_cached_tokens is None:
                req.num_cached_tokens = hit.num_tokens
                req.num_host_cached_tokens = alloc.num_host_tokens
            if req.status is RequestStatus.PREEMPTED:
                self._out.recomputed_tokens += max(0, len(seq.token_ids) - 1 - hit.num_tokens)
        self._add_chunk(req, seq, n)
        return "ok"

    def _add_chunk(self, req: Request, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        seq.num_computed += n
        table = self.kv.block_table(seq.seq_id)
        bs = self.kv.block_size
        if n == 1:
            self._writing.add(table[start // bs])
        else:
            self._writing.update(table[start // bs : (start + n - 1) // bs + 1])
        self._touched.add(req.request_id)
        self._budget -= n
        out = self._out
        wants_logits = seq.num_computed == len(seq.token_ids)
        out.chunks.append(ScheduledChunk(req, seq, start, n, wants_logits, table))
        out.num_batched_tokens += n
        if not (n == 1 and wants_logits and start > 0 and seq.num_output > 0):
            out.num_prefill_tokens += n
            out.num_partial_prefills += not wants_logits

    def _add_drafts(self, spec: Speculator, req: Request, seq: Sequence, num_decoding: int) -> None:
        """Extend ``seq``'s decode chunk (the last one scheduled) with draft tokens to verify,
        as far as the budget, the request's ``max_tokens`` and free KV slots allow. The draft
        slots are never hashed or cached (:meth:`KVCacheManager.append_draft_slots`)."""
        room = min(self._budget, req.max_new_tokens - seq.num_output - 1)
        drafts = spec.draft(req, seq, room, num_decoding) if room > 0 else []
        if not drafts or not self.kv.append_draft_slots(seq.seq_id, len(drafts)):
            return
        chunk = self._out.chunks[-1]
        assert chunk.seq is seq and chunk.num_tokens == 1
        n = len(drafts)
        chunk.drafts = drafts
        self._drafted.append(seq)
        chunk.num_tokens += n
        chunk.block_table = table = self.kv.block_table(seq.seq_id)
        bs = self.kv.block_size
        self._writing.update(table[chunk.start // bs : (chunk.start + n) // bs + 1])
        self._budget -= n
        self._out.num_batched_tokens += n
        self._out.num_draft_tokens += n

    def _make_room(self, req: Request) -> bool:
        """Preempt one request so ``req`` can grow; False if ``req`` must stop for this step."""
        victim = self.preemption.victim(req, self.running, self._touched)
        if victim is None:
            return False
        if victim is req and len(self.running) == 1:
            self._doom(req)  # alone and still too big: it can never fit
            return False
        self.preemption.preempt(victim, self.running, self._touched, self._out)
        return victim is not req

    def _doom(self, req: Request) -> None:
        if not req.doomed:
            req.doomed = True
            self._out.doomed.append(req)

    def _fits_watermark(self, seq: Sequence, total: int, hit: PrefixHit | None) -> bool:
        need = self.kv.blocks_needed(None, total, prefix=hit)
        return self.kv.can_fit(need + self._watermark)

    # ---- after the model -----------------------------------------------------------------

    def fork_samples(
        self, req: Request, parent: Sequence, texts: Seq[OutputText | None]
    ) -> list[Sequence]:
        """n > 1: fork the other samples off ``parent``, whose prompt was computed once
        (:func:`worker.engine.forking.fork_samples`)."""
        return fork_samples(self.kv, req, parent, texts)

    def update_from_output(self, out: RequestOutcome) -> None:
        """Apply one request's outcome: append its tokens, advance its beams (forking and
        freeing their blocks), give back the blocks of sequences that finished, and finish
        the request when none is left (:meth:`take_finished`)."""
        req = out.req
        drafted = out.drafted
        if out.beams is not None:
            req.protected = False
            req.progressed = True
        for o in out.seqs:
            seq = o.seq
            token = o.token
            if token is not None:
                req.protected = False
                req.progressed = True
                seq.token_ids.append(token)
                seq.new_tokens.append(token)
                if o.logprob is not None:
                    seq.new_logprobs.append(o.logprob)
                    seq.cumulative_logprob += o.logprob.logprob
            if o.finish is not None:
                seq.finish_reason, seq.stop_reason = o.finish, o.stop_reason
                self.free_seq(seq)  # blocks back at once, not when the request ends
                req.seqs.remove(seq)
                req.done_seqs.append(seq)
        if drafted is not None and drafted.allocated:
            # verified: all but the newest token are computed; rejected draft slots are not
            drafted.num_computed = len(drafted.token_ids) - 1
            self.kv.settle_drafts(drafted.seq_id, drafted.token_ids, drafted.num_computed)
            self._drafted.remove(drafted)
        if out.beam_done:
            for seq in req.seqs:
                self.free_seq(seq)
            req.seqs = []
        elif out.beams is not None:
            advance_beams(self.kv, req, out.beams, self.free_seq)
        if not req.seqs:
            self.finish(req)

    def abort(self, req: Request, error: str | None) -> None:
        """End ``req`` now, every sequence ``abort`` (``error``: why, if it failed)."""
        req.error = error
        for seq in req.seqs:
            seq.finish_reason = FinishReason.ABORT
        req.done_seqs.extend(req.seqs)
        req.seqs = []
        self.finish(req)

    def finish(self, req: Request) -> None:
        """Out of the queues, every block freed; the engine collects it (take_finished)."""
        self.remove(req)
        req.status = RequestStatus.FINISHED
        self._finished.append(req)

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call."""
        done, self._finished = self._finished, []
        return done


def _work(req: Request) -> list[Sequence]:
    """Sequences of ``req`` that need compute, laggards first (they were skipped before)."""
    if len(req.seqs) == 1:  # n == 1: nothing to order
        s = req.seqs[0]
        return [s] if s.num_remaining > 0 and s.pending_logits is None else []
    seqs = [s for s in req.seqs if s.num_remaining > 0 and s.pending_logits is None]
    return sorted(seqs, key=lambda s: (len(s.token_ids), s.index))
