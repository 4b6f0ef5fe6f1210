"""What a request's output message holds: its sequences' news (or, for beam search, the
best hypotheses once the search ends), usage, error and prompt logprobs; building one records
the request's TTFT and inter-token latency, and a finished request's phase times."""

from __future__ import annotations

import time

from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput
from worker.engine.detokenizer import TokenizerLike
from worker.engine.metrics import MetricsRecorder
from worker.engine.request import Request


def beam_deltas(req: Request, tokenizer: TokenizerLike | None) -> list[CompletionDelta]:
    """A finished beam search's best ``n`` hypotheses, decoded, best first (the live beams
    if none finished, e.g. every candidate impossible)."""
    assert req.beam is not None
    hyps = req.beam.results(req.params.n)
    if not hyps:
        req.beam.give_up([s.output_ids for s in req.seqs])
        hyps = req.beam.results(req.params.n)
    deltas = []
    for rank, hyp in enumerate(hyps):
        toks = hyp.token_ids
        shown = toks[:-1] if hyp.hit_stop else toks
        text = (
            tokenizer.decode(shown, skip_special_tokens=req.params.skip_special_tokens)
            if tokenizer is not None
            else ""
        )
        reason = FinishReason.STOP if hyp.hit_stop else FinishReason.LENGTH
        stop = toks[-1] if hyp.hit_stop and toks[-1] in req.params.stop_token_set else None
        deltas.append(CompletionDelta(rank, text, list(toks), None, reason, stop, hyp.score))
    return deltas


def request_output(req: Request, stats: MetricsRecorder, now: float | None) -> RequestOutput:
    """The request's news since its last output; with ``now``, a step that produced tokens
    records its TTFT (the first) or inter-token latency into ``stats``. A finished request's
    output (the last one it gets) records its queue, prefill, decode and inference times."""
    if req.final_deltas:  # beam search: results only at the end
        deltas = req.final_deltas
    elif len(req.seqs) + len(req.done_seqs) == 1:  # n == 1: nothing to order
        seq = req.seqs[0] if req.seqs else req.done_seqs[0]
        deltas = [seq.take_delta()] if seq.has_news else []
    else:
        seqs = sorted((*req.seqs, *req.done_seqs), key=lambda s: s.index)
        deltas = [s.take_delta() for s in seqs if s.has_news]
    progressed, req.progressed = req.progressed, False
    if now is not None and progressed:
        if req.first_token_time is None:
            req.first_token_time = now
            stats.ttft.append(now - req.arrival_time)
        else:
            stats.itl.append(now - (req.last_token_time or now))
        req.last_token_time = now
    if req.finished and stats.log_stats and req.admitted_time is not None:
        end = req.last_token_time or (now if now is not None else time.monotonic())
        stats.phases.finished(req.arrival_time, req.admitted_time, req.first_token_time, end)
    prompt = None
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and deltas:
        prompt, req.prompt_logprobs_sent = list(req.prompt_logprobs), True
    return RequestOutput(req.request_id, deltas, req.finished, req.usage(), req.error, prompt)
