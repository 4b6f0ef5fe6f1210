"""One request's moves from a worker that died mid-stream to another: what the client was
sent so far, the continuation to submit, and its outputs rewritten so the client's stream
goes on with no gap and no duplicate.

A continuation is the prompt plus the tokens already sent, with ``max_tokens`` and
``min_tokens`` reduced by their count: the new worker prefills it (its prefix cache, or a
peer pull, serves what it holds) and generates the rest; the worker is told how many prompt
tokens are output already sent (``WorkerRequest.continued``), which its penalties and seeded
draws count as output. A greedy or seeded request's continuation is token-identical to an
uninterrupted run (the model sees the same tokens, a seeded draw depends on its position);
what holds for each kind of request is in docs/failures.md. Only single-sequence requests
move: samples of ``n > 1`` and beams share state a continuation cannot carry, and a grammar's
matcher state (structured outputs) would start over; those end as a broken stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.outputs import CompletionDelta, RequestOutput, Usage
from kvstore.requests.sampling_params import SamplingParams

# kvc_migrations_total's reason label: the worker died (its actor or its node)
WORKER_DIED = "worker_died"


class Migration:
    """What one request sent its client, for continuing it elsewhere. ``limit``: moves
    allowed (0: none)."""

    def __init__(self, token_ids: list[int], params: SamplingParams, limit: int) -> None:
        self.prompt = token_ids
        self.params = params
        self.movable = (
            limit > 0 and params.n == 1 and params.beam_width == 1 and params.structured is None
        )
        self.limit = limit
        self.moves = 0  # continuations submitted
        self.sent: list[int] = []  # tokens the client got, over every attempt
        self._base_sent = 0  # of them, those sent before the current attempt
        self._base_logprob = 0.0  # cumulative logprob of those
        self._logprob: float | None = None  # the current attempt's latest cumulative logprob
        self._first_usage: Usage | None = None  # the first attempt's (what the client saw)

    def resume(self, sent: Sequence[int], vocab_size: int) -> None:
        """Start after ``sent``, the output tokens a client already has (it lost the router
        that streamed them); raises :class:`InvalidRequest` for a request that cannot
        continue."""
        if not (self.params.n == 1 and self.params.beam_width == 1):
            raise InvalidRequest("continue_from", "<tokens>", "needs n = 1 and no beam search")
        if self.params.structured is not None:
            raise InvalidRequest("continue_from", "<tokens>", "cannot continue a grammar")
        if not 0 < len(sent) < self.params.max_tokens:
            raise InvalidRequest(
                "continue_from", f"<{len(sent)} tokens>", "must hold 1 to max_tokens - 1 tokens"
            )
        if any(not 0 <= t < vocab_size for t in sent):
            raise InvalidRequest("continue_from", "<tokens>", f"ids must be in [0, {vocab_size})")
        self.movable = True
        self.sent = list(sent)
        self._base_sent = len(sent)

    def can_move(self) -> bool:
        """Whether the request may continue elsewhere now: it moves, has moves left and
        tokens left to generate."""
        return self.movable and self.moves < self.limit and self.remaining() > 0

    def remaining(self) -> int:
        return self.params.max_tokens - len(self.sent)

    def moved(self) -> None:
        """The current attempt died; the next one is a continuation."""
        assert self.can_move()
        self.moves += 1
        self._base_sent = len(self.sent)
        if self._logprob is not None:
            self._base_logprob = self._logprob
        self._logprob = None

    def attempt(self) -> tuple[list[int], SamplingParams, int]:
        """The next attempt's prompt, parameters and how many of the prompt's tokens are
        output already sent (they end the prompt)."""
        if not self.sent:
            return self.prompt, self.params, 0
        p = self.params
        params = replace(
            p,
            max_tokens=self.remaining(),
            min_tokens=max(0, p.min_tokens - len(self.sent)),
            prompt_logprobs=None,  # sent with the first attempt's first output
        )
        return self.prompt + self.sent, params, len(self.sent)

    def passed(self, out: RequestOutput) -> RequestOutput:
        """``out`` of the current attempt as the client sees it: usage counted from the
        original prompt (its cached tokens the first attempt's), cumulative logprob from the
        first token; the tokens recorded as sent."""
        if not self.movable:
            return out
        for d in out.outputs:
            self.sent.extend(d.token_ids)
            if d.cumulative_logprob is not None:
                self._logprob = self._base_logprob + d.cumulative_logprob
        if self._first_usage is None:
            self._first_usage = out.usage
        if self.moves == 0 and not self._base_sent:
            return out
        first = self._first_usage
        u = out.usage
        usage = Usage(
            len(self.prompt),
            first.cached_tokens if first is not None else 0,
            self._base_sent + u.completion_tokens,
            first.host_cached_tokens if first is not None else 0,
        )
        outputs = out.outputs
        if self._base_logprob:
            outputs = [
                d
                if d.cumulative_logprob is None
                else CompletionDelta(
                    d.index,
                    d.text,
                    d.token_ids,
                    d.logprobs,
                    d.finish_reason,
                    d.stop_reason,
                    self._base_logprob + d.cumulative_logprob,
                )
                for d in outputs
            ]
        return RequestOutput(out.request_id, outputs, out.finished, usage, out.error)
