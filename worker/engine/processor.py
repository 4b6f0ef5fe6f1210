"""After the model: logits -> tokens -> stop decisions, per request.

Runs in the engine's thread between two forward passes. The processor samples, advances beam
searches and applies stop rules and the detokenizer, and returns what it decided as one
:class:`RequestOutcome` per request; it holds no KV blocks and no queue. The scheduler applies
the outcomes (:meth:`Scheduler.update_from_output`): it appends the tokens, forks or frees
blocks, and finishes sequences and requests.

One request's failure is its own: an exception while sampling, stopping, detokenizing or
advancing the beams of one request is recorded in that request's outcome (``error``), the
engine fails that request alone and the others go on.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from kvstore.requests.outputs import FinishReason, RequestOutput, TokenLogprob
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.detokenizer import IncrementalDetokenizer, OutputText, TokenizerLike
from worker.engine.grammar_masks import GrammarMasks, TokenMask, allow_token, grammar_rows
from worker.engine.intake import banned_by_words
from worker.engine.logit_adjust import PenaltyRows, adjust
from worker.engine.metrics import MetricsRecorder
from worker.engine.outcome import RequestOutcome, SeqOutcome
from worker.engine.penalties import PenaltyCounts
from worker.engine.request import Request, Sequence
from worker.engine.request_output import beam_deltas, request_output
from worker.engine.sampler import SampleSpec, finite_rows, sample
from worker.engine.sched_output import ScheduledChunk, SchedulerOutput
from worker.model.reasoning_markers import ReasoningMarkers


class NonFiniteLogits(RuntimeError):
    """The model's logits for a request hold NaN or infinity: it is failed, never sampled."""


def _non_finite(req: Request) -> str:
    lora = f" with adapter {req.params.lora!r}" if req.params.lora else ""
    return (
        f"the model produced non-finite logits (NaN or infinity) for this request{lora}; "
        "it is stopped rather than sampled from them"
    )


class OutputProcessor:
    """Turns one step's logits into tokens and stop decisions for the requests that asked."""

    def __init__(
        self,
        *,
        tokenizer: TokenizerLike | None,
        eos_ids: frozenset[int],
        stats: MetricsRecorder,
        seed: int,
        spec_verified: Callable[[Request, int, int], None] | None = None,
        reasoning: ReasoningMarkers | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stats = stats  # TTFT / inter-token samples, recorded as outputs are built
        self._rng = torch.Generator().manual_seed(seed)  # for unseeded requests
        self._outcomes: dict[str, RequestOutcome] = {}  # this step's, by request id
        self.penalties = PenaltyCounts()  # token counts of the sequences that set penalties
        self.masks = GrammarMasks()  # this step's grammar masks (structured outputs)
        # a reasoning model's markers: grammars wait for the reasoning's end (structured.py)
        self.reasoning = reasoning
        # live requests with Request.may_open_reasoning: while none, a step pays nothing
        self.openers = 0
        self._logits_device = torch.device("cpu")  # where the last step's logits were
        # speculative decoding: told (request, drafts, accepted) after each verification
        self.spec_verified = spec_verified or (lambda req, drafts, accepted: None)

    def new_text(self, req: Request) -> OutputText | None:
        if self.tokenizer is None or req.beam is not None:
            return None
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.skip_special_tokens)
        return OutputText(detok, p.stop, p.include_stop_str_in_output)

    def _outcome(self, req: Request) -> RequestOutcome:
        out = self._outcomes.get(req.request_id)
        if out is None:
            out = self._outcomes[req.request_id] = RequestOutcome(req)
        return out

    def _guarded(self, req: Request, fn: Callable[[], object]) -> None:
        """Run one request's piece of work; an exception goes into its outcome."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one request's bug must not stop the engine
            self._outcome(req).error = exc

    def _failed(self, req: Request) -> bool:
        out = self._outcomes.get(req.request_id)
        return out is not None and out.error is not None

    def process(
        self,
        sched: SchedulerOutput,
        logits: torch.Tensor,
        forks: dict[int, list[Sequence]] | None = None,
    ) -> list[RequestOutcome]:
        """Sample / advance beams for every chunk that wanted logits. ``forks``: parent
        ``seq_id`` -> the samples forked from it in this step (n > 1), which sample from the
        parent's row. Returns one outcome per request with news."""
        forks = forks or {}
        self._outcomes = {}  # nothing left from a step that raised
        self._logits_device = logits.device
        jobs: list[tuple[Request, Sequence, int]] = []
        beams: dict[str, Request] = {}
        verifies: list[tuple[ScheduledChunk, int]] = []
        rows = itertools.count()
        for chunk in sched.chunks:
            if not chunk.wants_logits:
                continue
            row, req = next(rows), chunk.req
            if chunk.drafts:
                for _ in chunk.drafts:  # its further rows
                    next(rows)
                if not (req.doomed or req.finished):
                    verifies.append((chunk, row))
                continue
            if req.doomed or req.finished:
                continue
            if req.beam is not None:
                chunk.seq.pending_logits = logits[row].clone()
                beams[req.request_id] = req
            else:
                jobs.append((req, chunk.seq, row))
                jobs += [(req, kid, row) for kid in forks.get(chunk.seq.seq_id, ())]
        self._sample(jobs, logits)
        self._verify_all(verifies, logits)
        for req in beams.values():
            if all(s.pending_logits is not None for s in req.seqs):
                self._outcome(req)
                self._guarded(req, lambda r=req: self._beam_step(r))
        outcomes, self._outcomes = list(self._outcomes.values()), {}
        return outcomes

    def _sample(self, jobs: list[tuple[Request, Sequence, int]], logits: torch.Tensor) -> None:
        targets: list[tuple[Request, Sequence]] = []
        rows: list[int] = []
        specs: list[SampleSpec] = []
        penalized: list[tuple[Sequence, SamplingParams]] = []
        jobs = grammar_rows(jobs, self._guarded)  # (a matcher in error fails its request)
        for req, seq, row in jobs:
            targets.append((req, seq))
            rows.append(row)
            seq.seed_draw()  # a seeded draw depends on its output position alone
            spec = seq.spec
            if spec is None:
                banned = self.banned(req, seq)
                spec = SampleSpec(req.params, seq.generator, banned)
                if not banned and not req.bad_words:  # the same spec from now on
                    seq.spec = spec
            specs.append(spec)
            if spec.penalized:
                penalized.append((seq, req.params))
        if not targets:
            return
        t0 = time.perf_counter()
        try:
            counts = self._counts(penalized, logits)
            mask = self._mask(rows, targets, logits)
            # every row once, in order (the usual step): no copy of the logits
            batch = logits if rows == list(range(logits.shape[0])) else logits[rows]
            tokens = sample(batch, specs, self._rng, counts, mask)
            sampled = list(zip(targets, *tokens, strict=True))
        except Exception:  # noqa: BLE001 - find the request that broke the batch
            sampled = self._sample_each(targets, rows, specs, logits)
        self.stats.stages.sample += time.perf_counter() - t0
        for (req, seq), tok, lp in sampled:
            out = self._outcome(req)
            if out.error is not None:
                continue
            if tok is None:
                out.error = NonFiniteLogits(_non_finite(req))
                continue
            try:
                self._append(req, seq, tok, lp, out)
            except Exception as exc:  # noqa: BLE001 - one request's bug must not stop the engine
                out.error = exc
        if self.openers:  # their first token is sampled (forks sample theirs in the same step)
            for req, _ in targets:
                if req.may_open_reasoning:
                    req.may_open_reasoning = False
                    self.openers -= 1

    def _mask(
        self, rows: list[int], targets: list[tuple[Request, Sequence]], logits: torch.Tensor
    ) -> TokenMask | None:
        """The grammar mask of ``targets`` (sampling logits ``rows``): a request's first
        token may also open its reasoning (``Request.may_open_reasoning``)."""
        matchers = [seq.matcher for _, seq in targets]
        mask = self.masks.mask(rows, matchers, logits)
        if mask is not None and self.openers:
            opening = [i for i, (req, _) in enumerate(targets) if req.may_open_reasoning]
            if opening:
                assert self.reasoning is not None
                allow_token(mask, matchers, opening, self.reasoning.start_id)
        return mask

    def _verify_all(self, verifies: list[tuple[ScheduledChunk, int]], logits: torch.Tensor) -> None:
        """Sample the rows of every chunk carrying drafts in one call (per-chunk calls cost
        ~0.1 ms of host time each: 6 ms a step at 64 sequences), then check each chunk's
        drafts. Speculating requests are unseeded (``speculator.eligible``), so a chunk's
        rows draw from the engine's generator wherever they sit in the batch."""
        if not verifies:
            return
        rows: list[int] = []
        specs: list[SampleSpec] = []
        for chunk, row in verifies:
            seq = chunk.seq
            spec = seq.spec
            if spec is None:
                spec = seq.spec = SampleSpec(chunk.req.params, seq.generator, ())
            n = len(chunk.drafts) + 1
            rows += range(row, row + n)
            specs += [spec] * n
        t0 = time.perf_counter()
        tokens: list[int | None] | None
        try:
            batch = logits if rows == list(range(logits.shape[0])) else logits[rows]
            tokens, _ = sample(batch, specs, self._rng, None, None)
        except Exception:  # noqa: BLE001 - each chunk alone finds the request that broke it
            tokens = None
        self.stats.stages.sample += time.perf_counter() - t0
        at = 0
        for chunk, row in verifies:
            n = len(chunk.drafts) + 1
            mine = tokens[at : at + n] if tokens is not None else None
            at += n
            self._guarded(chunk.req, lambda c=chunk, r=row, t=mine: self._verify(c, r, logits, t))

    def _verify(
        self,
        chunk: ScheduledChunk,
        row: int,
        logits: torch.Tensor,
        tokens: list[int | None] | None,
    ) -> None:
        """Keep a chunk's sampled tokens (``tokens``, one per row; None: sample its rows
        here) while each equals the draft it checks: all of the matching drafts, then the
        first token that differs (or follows the last draft). Greedy: exact match; sampled:
        the draft is deterministic, so accepting while the sampled token equals it leaves the
        output distribution as is."""
        req, seq, drafts = chunk.req, chunk.seq, chunk.drafts
        out = self._outcome(req)
        out.drafted = seq
        if tokens is None:  # (the batched call failed: its spec was set there)
            n = len(drafts) + 1
            tokens, _ = sample(logits[row : row + n], [seq.spec] * n, self._rng, None, None)
        accepted = 0
        for i, tok in enumerate(tokens):
            if tok is None:
                raise NonFiniteLogits(_non_finite(req))
            self._append(req, seq, tok, None, out, already=i)
            if out.seqs[-1].finish is not None or i == len(drafts) or tok != drafts[i]:
                break
            accepted += 1
        self.spec_verified(req, len(drafts), accepted)

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
            for i in idx:  # the failed batch may have drawn from them
                targets[i][1].seed_draw()
            try:
                counts = self._counts(mine, logits)
                mask = self._mask([rows[i] for i in idx], [targets[i] for i in idx], logits)
                toks, lps = sample(
                    logits[[rows[i] for i in idx]], [specs[i] for i in idx], self._rng, counts, mask
                )
            except Exception as exc:  # noqa: BLE001
                self._outcome(req).error = exc
                continue
            out += [(targets[i], t, p) for i, t, p in zip(idx, toks, lps, strict=True)]
        return out

    def _counts(
        self, penalized: list[tuple[Sequence, SamplingParams]], logits: torch.Tensor
    ) -> PenaltyRows | None:
        if not penalized:
            return None
        return self.penalties.rows(penalized, logits.shape[-1], logits.device)

    def start_masks(self, sched: SchedulerOutput, vocab: int) -> None:
        """Before the model runs: begin filling the grammar masks of the rows that will
        sample (rows counted as :meth:`process` counts them)."""
        rows = {}
        logits_rows = (c for c in sched.chunks if c.wants_logits)
        for row, chunk in enumerate(logits_rows):
            m = chunk.seq.matcher
            if m is not None and chunk.req.beam is None and not m.is_error():
                rows[row] = m
        self.masks.start(rows, vocab, self._logits_device)

    def release(self, req: Request) -> None:
        """``req`` finished: its sequences' penalty rows are free."""
        if req.may_open_reasoning:  # (it ended before its first token)
            req.may_open_reasoning = False
            self.openers -= 1
        if req.params.has_penalties:
            for seq in (*req.seqs, *req.done_seqs):
                self.penalties.release(seq.seq_id)

    def banned(self, req: Request, seq: Sequence) -> tuple[int, ...]:
        """The ids ``seq`` may not sample now: EOS and the stop ids before min_tokens, and
        what would complete a bad word."""
        p = req.params
        words = banned_by_words(req.bad_words, seq) if req.bad_words else ()
        if seq.num_output >= p.min_tokens:
            return tuple(words)
        # a grammar decides where the output may end: EOS stays allowed where it allows it
        # (a grammar held while the sequence reasons decides nothing yet)
        eos = () if p.ignore_eos or seq.matcher is not None else tuple(self.eos_ids)
        return (*eos, *p.stop_token_ids, *words)

    def _append(
        self,
        req: Request,
        seq: Sequence,
        tok: int,
        lp: TokenLogprob | None,
        out: RequestOutcome,
        already: int = 0,
    ) -> None:
        """Decide what ``tok`` does to ``seq`` (stop token, EOS, stop string, length) and
        record it in ``out`` (``req``'s outcome); the scheduler appends it. ``already``:
        tokens of ``seq`` recorded before it in this step (verified drafts)."""
        p = req.params
        num_output = seq.num_output + 1 + already  # with tok
        check = num_output >= p.min_tokens
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
        matcher, markers = seq.matcher, self.reasoning
        if matcher is not None:
            if req.may_open_reasoning and markers is not None and tok == markers.start_id:
                # it opens its reasoning: the grammar waits, unadvanced, for the answer
                seq.held_matcher, seq.matcher = matcher, None
                seq.spec = None  # EOS is banned again before min_tokens, as without a grammar
            elif not matcher.consume_token(tok):
                raise RuntimeError(f"the grammar refused token {tok}: {matcher.get_error()}")
            elif reason is None and matcher.is_stopped():
                reason = FinishReason.STOP  # the grammar is complete: nothing may follow
        elif seq.held_matcher is not None and markers is not None and tok == markers.end_id:
            seq.matcher, seq.held_matcher = seq.held_matcher, None  # the answer starts next
        if reason is None and num_output >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            if seq.text is not None:
                seq.text.finish(flush=not isinstance(stop_reason, str))
            self.penalties.release(seq.seq_id)  # it samples no more
        out.seqs.append(SeqOutcome(seq, tok, lp, reason, stop_reason))

    def capacity(self, req: Request) -> RequestOutcome:
        """The request cannot fit the KV cache even alone: every sequence ends ``length``
        (beam search: with the best hypotheses so far)."""
        out = RequestOutcome(req)
        if req.beam is not None:
            req.beam.give_up([s.output_ids for s in req.seqs])
            self._beam_results(req)
            out.beam_done = True
            return out
        for seq in req.seqs:
            if seq.text is not None:
                seq.text.finish(flush=True)
            out.seqs.append(SeqOutcome(seq, None, None, FinishReason.LENGTH, "kv_capacity"))
        return out

    # ---- beam search ---------------------------------------------------------------------

    def _beam_step(self, req: Request) -> None:
        assert req.beam is not None
        seqs = req.seqs
        logits = torch.stack([s.pending_logits for s in seqs])
        if not bool(finite_rows(logits).all()):
            raise NonFiniteLogits(_non_finite(req))
        specs = []
        for s in seqs:
            s.pending_logits = None
            specs.append(SampleSpec(req.params, None, self.banned(req, s)))
        # as transformers' beam search runs its processors: on the log-probabilities
        # (logit_bias, allowed_token_ids, ids banned before min_tokens)
        logprobs = adjust(logits.log_softmax(dim=-1), specs, None)
        out = self._outcome(req)
        out.beams = req.beam.step(logprobs, [s.output_ids for s in seqs])
        if req.beam.done:
            self._beam_results(req)
            out.beam_done = True

    def _beam_results(self, req: Request) -> None:
        """The search ended: its best ``n`` hypotheses, decoded, as the final deltas."""
        req.final_deltas.extend(beam_deltas(req, self.tokenizer))

    def output(self, req: Request, now: float | None = None) -> RequestOutput:
        """The request's news since its last output (``now``: records TTFT / ITL)."""
        return request_output(req, self.stats, now)
