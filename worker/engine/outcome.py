"""What the output processor decided for one request in one step; the scheduler applies it
(:meth:`Scheduler.update_from_output`): appends the tokens, forks or frees beams' blocks,
finishes sequences and requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.requests.outputs import FinishReason, TokenLogprob

if TYPE_CHECKING:
    from worker.engine.request import Request, Sequence


@dataclass(slots=True)
class SeqOutcome:
    """One sequence's news: the token sampled for it, and whether it stops there."""

    seq: Sequence
    token: int | None  # None: it finishes without a new token (the KV cache is too small)
    logprob: TokenLogprob | None = None  # the token's logprobs, if the request asked
    finish: FinishReason | None = None  # the sequence ends with this token
    stop_reason: str | int | None = None  # the stop string / stop token id that ended it


@dataclass(slots=True)
class RequestOutcome:
    """One request's news from one step."""

    req: Request
    seqs: list[SeqOutcome] = field(default_factory=list)  # parallel samples
    beams: list[tuple[int, int]] | None = None  # beam search: (parent beam, token) per new
    # beam, by rank; None for sampled requests
    beam_done: bool = False  # the search ended: the results are in ``req.final_deltas``
    error: BaseException | None = None  # processing this request raised: it is failed
    drafted: Sequence | None = None  # its sequence verified drafts in this step: the
    # scheduler rewinds its computed count to the verified tokens

    @property
    def num_tokens(self) -> int:
        """Tokens generated (sampled or chosen as beams) in this step."""
        seqs = self.seqs
        if len(seqs) == 1 and self.beams is None:  # n == 1: the usual outcome
            return seqs[0].token is not None
        return sum(o.token is not None for o in seqs) + len(self.beams or ())
