"""After the model: logits -> tokens -> stops, forks, beams, finished requests, outputs.

Everything here runs in the engine's thread between two forward passes. Sequences give their
KV blocks back the moment they finish (a pruned beam, a stopped sample), not when their
request ends.

One request's failure is its own: an exception while sampling, stopping, detokenizing or
advancing the beams of one request ends that request with an error (the gRPC edge answers
INTERNAL with the message) and the others go on (:meth:`OutputProcessor.fail`).
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from collections.abc import Callable

import torch

from kvstore.blocks.outputs import CompletionDelta, FinishReason, RequestOutput, TokenLogprob
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine.detokenizer import IncrementalDetokenizer, OutputText, TokenizerLike
from worker.engine.metrics import MetricsRecorder
from worker.engine.penalties import PenaltyCounts
from worker.engine.request import Request, RequestStatus, Sequence, sample_generator
from worker.engine.sampler import PenaltyRows, SampleSpec, sample
from worker.engine.sched_output import SchedulerOutput
from worker.engine.scheduler import Scheduler
from worker.kv import KVCacheManager

log = logging.getLogger(__name__)


class OutputProcessor:
    """Applies one step's logits to the requests that asked for them."""

    def __init__(
        self,
        *,
        kv: KVCacheManager,
        scheduler: Scheduler,
        tokenizer: TokenizerLike | None,
        eos_ids: frozenset[int],
        stats: MetricsRecorder,
        requests: dict[str, Request],
        seed: int,
    ) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stats = stats
        self.requests = requests  # the engine's live requests (finished ones are removed)
        self._rng = torch.Generator().manual_seed(seed)  # for unseeded requests
        self.penalties = PenaltyCounts()  # token counts of the sequences that set penalties

    def new_text(self, req: Request) -> OutputText | None:
        if self.tokenizer is None or req.beam is not None:
            return None
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.skip_special_tokens)
        return OutputText(detok, p.stop, p.include_stop_str_in_output)

    def fail(self, req: Request, exc: BaseException) -> None:
        """Processing ``req`` raised: end it (and only it) with an error, blocks freed."""
        log.exception(
            "request %s failed inside the engine; it is aborted, the engine goes on",
            req.request_id,
            exc_info=exc,
        )
        if not req.finished:
            req.final_deltas.clear()
            self.abort(req, f"internal error processing the request: {type(exc).__name__}: {exc}")

    def guarded(self, req: Request, fn: Callable[[], object]) -> bool:
        """Run one request's piece of work; False (and the request failed) if it raised."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one request's bug must not stop the engine
            self.fail(req, exc)
            return False
        return True

    def abort(self, req: Request, error: str | None) -> None:
        req.error = error
        for seq in req.seqs:
            seq.finish_reason = FinishReason.ABORT
        req.done_seqs.extend(req.seqs)
        req.seqs = []
        self.finish_request(req)

    def process(self, sched: SchedulerOutput, logits: torch.Tensor) -> dict[str, Request]:
        """Sample / advance beams for every chunk that wanted logits; the requests changed."""
        changed: dict[str, Request] = {}
        jobs: list[tuple[Request, Sequence, int]] = []
        beams: dict[str, Request] = {}
        rows = itertools.count()
        for chunk in sched.chunks:
            if not chunk.wants_logits:
                continue
            row, req = next(rows), chunk.req
            if req.doomed or req.finished:
                continue
            if req.beam is not None:
                chunk.seq.pending_logits = logits[row].clone()
                beams[req.request_id] = req
            else:
                jobs.append((req, chunk.seq, row))
        self._sample(jobs, logits, changed)
        for req in beams.values():
            if all(s.pending_logits is not None for s in req.seqs):
                changed[req.request_id] = req
                self.guarded(req, lambda r=req: self._beam_step(r))
        return changed

    def _sample(
        self,
        jobs: list[tuple[Request, Sequence, int]],
        logits: torch.Tensor,
        changed: dict[str, Request],
    ) -> None:
        targets: list[tuple[Request, Sequence]] = []
        rows: list[int] = []
        specs: list[SampleSpec] = []
        penalized: list[tuple[Sequence, SamplingParams]] = []
        for req, seq, row in jobs:
            group = [seq]
            if not req.forked:  # n > 1: the prompt is computed once, then forked
                req.forked = True
                changed[req.request_id] = req
                fork = lambda r=req, s=seq, g=group: g.extend(self._fork_samples(r, s))  # noqa: E731
                if not self.guarded(req, fork):
                    continue
            for s in group:
                targets.append((req, s))
                rows.append(row)
                specs.append(SampleSpec(req.params, s.generator, self._banned(req, s)))
                if req.params.has_penalties:
                    penalized.append((s, req.params))
        if not targets:
            return
        try:
            counts = self._counts(penalized, logits)
            tokens = sample(logits[rows], specs, self._rng, counts)
            sampled = list(zip(targets, *tokens, strict=True))
        except Exception:  # noqa: BLE001 - find the request that broke the batch
            sampled = self._sample_each(targets, rows, specs, logits)
        for (req, seq), tok, lp in sampled:
            changed[req.request_id] = req
            if not req.finished:
                self.guarded(req, lambda r=req, s=seq, t=tok, p=lp: self._append(r, s, t, p))

    def _sample_each(
        self,
        targets: list[tuple[Request, Sequence]],
        rows: list[int],
        specs: list[SampleSpec],
        logits: torch.Tensor,
    ) -> list[tuple[tuple[Request, Sequence], int, TokenLogprob | None]]:
        """The batch failed: sample each request alone; the ones that still fail are failed."""
        by_req: dict[str, list[int]] = defaultdict(list)
        for i, (req, _) in enumerate(targets):
            by_req[req.request_id].append(i)
        out = []
        for idx in by_req.values():
            req = targets[idx[0]][0]
            mine = [(targets[i][1], req.params) for i in idx if req.params.has_penalties]
            try:
                counts = self._counts(mine, logits)
                toks, lps = sample(
                    logits[[rows[i] for i in idx]], [specs[i] for i in idx], self._rng, counts
                )
            except Exception as exc:  # noqa: BLE001
                self.fail(req, exc)
                continue
            out += [(targets[i], t, p) for i, t, p in zip(idx, toks, lps, strict=True)]
        return out

    def _counts(
        self, penalized: list[tuple[Sequence, SamplingParams]], logits: torch.Tensor
    ) -> PenaltyRows | None:
        if not penalized:
            return None
        return self.penalties.rows(penalized, logits.shape[-1], logits.device)

    def _fork_samples(self, req: Request, seq: Sequence) -> list[Sequence]:
        kids = []
        for i in range(1, req.params.n):
            child = seq.fork(i, sample_generator(req.params.seed, i), self.new_text(req))
            self.kv.fork(seq.seq_id, child.seq_id)
            kids.append(child)
        req.seqs.extend(kids)
        return kids

    def _banned(self, req: Request, seq: Sequence) -> tuple[int, ...]:
        p = req.params
        if seq.num_output >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_ids)
        return (*eos, *p.stop_token_ids)

    def _append(self, req: Request, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        p = req.params
        seq.token_ids.append(tok)
        seq.new_tokens.append(tok)
        if lp is not None:
            seq.new_logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        self.stats.generation_tokens += 1
        req.protected = False
        req.progressed = True
        check = seq.num_output >= p.min_tokens
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        if check and tok in p.stop_token_set:
            reason, stop_reason = FinishReason.STOP, tok
        elif check and not p.ignore_eos and tok in self.eos_ids:
            reason = FinishReason.STOP
        if seq.text is not None:
            matched = seq.text.add(tok, check_stops=check, show=reason is None)
            if matched is not None and reason is None:
                reason, stop_reason = FinishReason.STOP, matched
        if reason is None and seq.num_output >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish_seq(req, seq, reason, stop_reason)

    def _finish_seq(
        self, req: Request, seq: Sequence, reason: FinishReason, stop_reason: str | int | None
    ) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.text is not None:
            seq.text.finish(flush=not isinstance(stop_reason, str))
        self.scheduler.free_seq(seq)
        self.penalties.release(seq.seq_id)
        req.seqs.remove(seq)
        req.done_seqs.append(seq)
        if not req.seqs:
            self.finish_request(req)

    def finish_request(self, req: Request) -> None:
        self.scheduler.remove(req)
        if req.params.has_penalties:
            for seq in (*req.seqs, *req.done_seqs):
                self.penalties.release(seq.seq_id)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self.stats.num_finished += 1
        self.stats.prompt_tokens += req.prompt_len

    # ---- beam search ---------------------------------------------------------------------

    def _beam_step(self, req: Request) -> None:
        assert req.beam is not None
        seqs = req.seqs
        logprobs = torch.stack([s.pending_logits for s in seqs]).log_softmax(dim=-1)
        for i, s in enumerate(seqs):
            s.pending_logits = None
            banned = self._banned(req, s)
            if banned:
                logprobs[i, list(banned)] = float("-inf")
        nxt = req.beam.step(logprobs, [s.output_ids for s in seqs])
        self.stats.generation_tokens += len(nxt)
        req.protected = False
        req.progressed = True
        if req.beam.done:
            self._finish_beam(req)
            return
        children: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for rank, (parent, tok) in enumerate(nxt):
            children[parent].append((rank, tok))
        new: list[Sequence | None] = [None] * len(nxt)
        for parent, seq in enumerate(seqs):
            mine = children.get(parent)
            if not mine:
                self.scheduler.free_seq(seq)  # pruned beam: blocks back at once
                continue
            for rank, tok in mine[1:]:  # fork before the parent appends its own token
                child = seq.fork(rank, None, None)
                self.kv.fork(seq.seq_id, child.seq_id)
                child.token_ids.append(tok)
                new[rank] = child
            rank, tok = mine[0]
            seq.token_ids.append(tok)
            seq.index = rank
            new[rank] = seq
        req.seqs = [s for s in new if s is not None]

    def _finish_beam(self, req: Request) -> None:
        assert req.beam is not None
        hyps = req.beam.results(req.params.n)
        if not hyps:  # nothing finished (e.g. every candidate impossible): the live beams
            req.beam.give_up([s.output_ids for s in req.seqs])
            hyps = req.beam.results(req.params.n)
        for rank, hyp in enumerate(hyps):
            toks = hyp.token_ids
            shown = toks[:-1] if hyp.hit_stop else toks
            text = (
                self.tokenizer.decode(shown, skip_special_tokens=req.params.skip_special_tokens)
                if self.tokenizer is not None
                else ""
            )
            reason = FinishReason.STOP if hyp.hit_stop else FinishReason.LENGTH
            stop = toks[-1] if hyp.hit_stop and toks[-1] in req.params.stop_token_set else None
            req.final_deltas.append(
                CompletionDelta(rank, text, list(toks), None, reason, stop, hyp.score)
            )
        for seq in list(req.seqs):
            self.scheduler.free_seq(seq)
        req.seqs.clear()
        self.finish_request(req)

    def finish_capacity(self, req: Request) -> None:
        """The request cannot fit the KV cache even alone: end it with ``length``."""
        if req.beam is not None:
            req.beam.give_up([s.output_ids for s in req.seqs])
            self._finish_beam(req)
            return
        for seq in list(req.seqs):
            self._finish_seq(req, seq, FinishReason.LENGTH, "kv_capacity")
        if not req.finished:
            self.finish_request(req)

    def output(self, req: Request, now: float | None = None) -> RequestOutput:
        seqs = sorted((*req.seqs, *req.done_seqs), key=lambda s: s.index)
        if req.final_deltas:  # beam search: results only at the end
            deltas = req.final_deltas
        else:
            deltas = [s.take_delta() for s in seqs if s.has_news]
        progressed, req.progressed = req.progressed, False
        if now is not None and progressed:
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.ttft.append(now - req.arrival_time)
            else:
                self.stats.itl.append(now - (req.last_token_time or now))
            req.last_token_time = now
        return RequestOutput(req.request_id, deltas, req.finished, req.usage(), req.error)
