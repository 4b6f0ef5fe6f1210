"""After the model: the scheduler applies what the output processor decided.

It appends each request's tokens, forks and prunes beams (and forks the parallel samples of a
prompt) with copy-on-write blocks, gives back the blocks of every finished sequence at once,
and finishes requests; the engine collects them with :meth:`OutcomeUpdates.take_finished`.
:class:`OutcomeUpdates` is mixed into :class:`~worker.engine.scheduler.Scheduler`, which owns
the queues and the KV manager.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvstore.blocks.outputs import FinishReason
from worker.engine.detokenizer import OutputText
from worker.engine.forking import advance_beams, fork_samples
from worker.engine.outcome import RequestOutcome
from worker.engine.request import Request, RequestStatus, Sequence

if TYPE_CHECKING:
    from worker.kv import KVCacheManager


class OutcomeUpdates:
    """Applying outcomes, aborting and finishing requests (state set up by
    ``Scheduler.__init__``)."""

    kv: KVCacheManager
    _finished: list[Request]  # finished or aborted, not yet taken by the engine

    if TYPE_CHECKING:  # the Scheduler's (queues)

        def remove(self, req: Request) -> None: ...

        def free_seq(self, seq: Sequence, *, offload: bool = True) -> None: ...

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
