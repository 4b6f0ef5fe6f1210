"""What the engine hands back: streamed deltas per step and the final result of a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvstore.requests.wire import schema_fingerprint


class FinishReason(StrEnum):
    """Why a sample ended (the values are the wire strings)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, max_model_len, or the KV cache cannot hold it
    ABORT = "abort"  # aborted by the caller or failed


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token (raw model distribution) and its alternatives."""

    token_id: int  # the generated token
    logprob: float  # its log-probability
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request (cumulative)."""

    prompt_tokens: int  # tokens of the prompt
    cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    completion_tokens: int  # generated tokens over all samples returned so far
    host_cached_tokens: int = 0  # of cached_tokens, those loaded back from the host KV tier


@dataclass(slots=True)
class CompletionDelta:
    """New output of one sample (or final beam) since the previous ``RequestOutput``."""

    index: int  # which sample (0..n-1) or beam rank (0 = best)
    text: str  # new text
    token_ids: list[int]  # new token ids
    logprobs: list[TokenLogprob] | None = None  # per new token, if requested
    finish_reason: FinishReason | None = None  # set once, on the sample's last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    cumulative_logprob: float | None = None  # sum of the token logprobs so far (beam: score)


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request; streamed to the caller."""

    request_id: str  # the id given to / returned by ``add_request``
    outputs: list[CompletionDelta]  # samples that changed in this step
    finished: bool  # True on the request's last output
    usage: Usage  # cumulative token counts
    error: str | None = None  # set when the request failed inside the engine
    # with SamplingParams.prompt_logprobs, once (on the first output): per prompt position,
    # that token's logprob and alternatives (position 0 has nothing before it: None)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class Completion:
    """One finished sample, accumulated from its deltas."""

    index: int  # sample index or beam rank
    text: str = ""  # generated text (stop string excluded unless asked)
    token_ids: list[int] = field(default_factory=list)  # generated token ids (incl. EOS)
    logprobs: list[TokenLogprob] | None = None  # per token, if requested
    finish_reason: FinishReason | None = None  # why it ended
    stop_reason: str | int | None = None  # matched stop string / token id
    cumulative_logprob: float | None = None  # sum of logprobs (beam search: final score)


@dataclass(slots=True)
class GenerationResult:
    """Everything a request produced (what ``Engine.generate`` returns per prompt)."""

    request_id: str  # the request's id
    completions: list[Completion]  # by index (beam search: best first)
    usage: Usage | None = None  # final usage
    error: str | None = None  # set if the request failed
    prompt_logprobs: list[TokenLogprob | None] | None = None  # if requested

    @property
    def finished(self) -> bool:
        return bool(self.completions) and all(c.finish_reason for c in self.completions)

    def add(self, out: RequestOutput) -> None:
        """Fold one streamed ``RequestOutput`` into this result."""
        by_index = {c.index: c for c in self.completions}
        for delta in out.outputs:
            comp = by_index.get(delta.index)
            if comp is None:
                comp = by_index[delta.index] = Completion(delta.index)
                self.completions.append(comp)
            comp.text += delta.text
            comp.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                comp.logprobs = (comp.logprobs or []) + delta.logprobs
            if delta.finish_reason is not None:
                comp.finish_reason = delta.finish_reason
                comp.stop_reason = delta.stop_reason
            if delta.cumulative_logprob is not None:
                comp.cumulative_logprob = delta.cumulative_logprob
        self.completions.sort(key=lambda c: c.index)
        self.usage = out.usage
        if out.error is not None:
            self.error = out.error
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


def relabelled(o: RequestOutput, request_id: str) -> RequestOutput:
    """``o`` under another request id, as a new output (``o`` may be shared); what
    ``dataclasses.replace`` makes, for a fraction of its cost (it runs once per token)."""
    return RequestOutput(request_id, o.outputs, o.finished, o.usage, o.error, o.prompt_logprobs)


def coalesce(outs: list[RequestOutput]) -> RequestOutput:
    """Several consecutive outputs of one request as one: each sample's deltas joined in
    order (text, token ids, logprobs), its last finish and cumulative logprob, the last
    usage and finished flag, the last error. What a client that reads slower than the engine
    produces gets instead of the outputs one by one; the tokens and their count are exact."""
    if len(outs) == 1:
        return outs[0]
    merged: dict[int, CompletionDelta] = {}
    for out in outs:
        for d in out.outputs:
            m = merged.get(d.index)
            if m is None:
                lps = list(d.logprobs) if d.logprobs is not None else None
                merged[d.index] = CompletionDelta(
                    d.index,
                    d.text,
                    list(d.token_ids),
                    lps,
                    d.finish_reason,
                    d.stop_reason,
                    d.cumulative_logprob,
                )
                continue
            m.text += d.text
            m.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                m.logprobs = (m.logprobs or []) + d.logprobs
            if d.finish_reason is not None:
                m.finish_reason, m.stop_reason = d.finish_reason, d.stop_reason
            if d.cumulative_logprob is not None:
                m.cumulative_logprob = d.cumulative_logprob
    last = outs[-1]
    error = next((o.error for o in reversed(outs) if o.error is not None), None)
    prompt = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return RequestOutput(
        last.request_id, list(merged.values()), last.finished, last.usage, error, prompt
    )


PackedOutput = tuple  # what pack_output makes: plain tuples pickle ~6x faster than dataclasses
# The packed layout (positional: the per-step hot path). A router sends it when it opens a
# channel; a worker with another layout refuses the channel instead of misreading it.
OUTPUT_SCHEMA = schema_fingerprint(
    RequestOutput, CompletionDelta, Usage, TokenLogprob, FinishReason
)


def pack_output(o: RequestOutput) -> PackedOutput:
    """``o`` as plain tuples, for a wire that pickles (a batch of a step's outputs)."""
    u = o.usage
    return (
        o.request_id,
        [
            (
                d.index,
                d.text,
                d.token_ids,
                d.logprobs,
                d.finish_reason,
                d.stop_reason,
                d.cumulative_logprob,
            )
            for d in o.outputs
        ],
        o.finished,
        (u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.host_cached_tokens),
        o.error,
        o.prompt_logprobs,
    )


def unpack_output(p: PackedOutput) -> RequestOutput:
    """The :class:`RequestOutput` that :func:`pack_output` packed."""
    rid, deltas, finished, usage, error, prompt = p
    deltas = [CompletionDelta(*d) for d in deltas]
    return RequestOutput(rid, deltas, finished, Usage(*usage), error, prompt)
