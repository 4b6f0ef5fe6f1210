"""Beam search of one request, decision for decision the same as ``transformers``.

This is the bookkeeping of ``GenerationMixin._beam_search`` (transformers 4.50+/5.x) for one
prompt, without tensors of fixed size: per step it takes the processed log-probabilities of
the live beams and returns the next live beams as (parent, token) pairs; the engine maps
them onto sequences that share KV blocks (fork for a second child, free for a pruned
parent). Mirrored exactly, because ties and the stopping heuristics decide the output:

* candidates: top ``K = max(2, 1 + #stop ids) * width`` of ``beam_score + logprob`` over all
  beams and tokens; a candidate "hits" if its token is a stop id or it reaches max length;
* next live beams: the best ``width`` candidates that do not hit;
* finished hypotheses: among the first ``width`` candidates, those that hit, scored
  ``logprob_sum / generated_len ** length_penalty``, merged with the previous finished list
  (best ``width`` kept) — unless all slots are finished and ``early_stopping is True``, or the
  early-stop heuristic says no improvement is possible;
* the heuristic compares the best live beam's score at the best hypothetical length
  (``max_new_tokens`` when ``early_stopping == "never"`` and the penalty is positive,
  else the current length) with the worst finished score;
* stop when no improvement is possible, or all slots are finished and
  ``early_stopping is True``, or every candidate hit.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

NEG = -1.0e9  # transformers' "never pick this" score offset


@dataclass(frozen=True, slots=True)
class BeamHypothesis:
    """A finished beam: generated tokens (incl. the stop token) and its final score."""

    token_ids: list[int]  # generated tokens
    score: float  # logprob sum / len ** length_penalty
    hit_stop: bool  # ended with a stop token (else: max length)


class BeamSearch:
    """State of one request's beam search across steps."""

    def __init__(
        self,
        width: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_new_tokens: int,
        stop_ids: Collection[int],
    ) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self.stop_ids = frozenset(stop_ids)
        self.keep = max(2, 1 + len(self.stop_ids)) * width
        self.running_scores = torch.zeros(1)  # cumulative logprob per live beam, best first
        self.finished_scores = torch.full((width,), NEG)  # slots, best first
        self.finished_flags = torch.zeros(width, dtype=torch.bool)
        self.finished_tokens: list[list[int] | None] = [None] * width
        self._improvable = True  # the early-stop heuristic is not satisfied yet
        self.done = False

    def step(self, log_probs: torch.Tensor, outputs: Sequence[list[int]]) -> list[tuple[int, int]]:
        """Advance one token.

        ``log_probs`` [live beams, vocab]: log-softmax of each beam's logits after processors
        (e.g. min_tokens masking); ``outputs``: each live beam's generated tokens (equal
        lengths). Returns the next live beams as (parent index, token), best first; sets
        ``done`` when the search is over.
        """
        assert not self.done and log_probs.shape[0] == len(outputs) == len(self.running_scores)
        gen_len = len(outputs[0])
        vocab = log_probs.shape[1]
        acc = (log_probs.float() + self.running_scores[:, None]).reshape(-1)
        k = min(self.keep, acc.numel())
        top_lp, top_idx = torch.topk(acc, k)
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        at_max = gen_len + 1 >= self.max_new_tokens
        hits = torch.tensor([at_max or t in self.stop_ids for t in tokens])

        running_lp = top_lp + hits.to(torch.float32) * NEG
        nxt = torch.topk(running_lp, min(self.width, k))[1]
        self.running_scores = running_lp[nxt]
        next_beams = [(parents[i], tokens[i]) for i in nxt.tolist()]

        scores = top_lp / ((gen_len + 1) ** self.length_penalty)
        if bool(self.finished_flags.all()) and self.early_stopping is True:
            scores = scores + NEG
        if not self._improvable:
            scores = scores + NEG
        just_finished = hits & (torch.arange(k) < self.width)
        scores = scores + (~just_finished).to(torch.float32) * NEG
        merged_scores = torch.cat((self.finished_scores, scores))
        merged_flags = torch.cat((self.finished_flags, just_finished))
        merged_tokens = self.finished_tokens + [
            [*outputs[p], t] for p, t in zip(parents, tokens, strict=True)
        ]
        sel = torch.topk(merged_scores, self.width)[1]
        self.finished_scores = merged_scores[sel]
        self.finished_flags = merged_flags[sel]
        self.finished_tokens = [merged_tokens[i] for i in sel.tolist()]

        self._update_heuristic(gen_len + 1)
        all_finished = bool(self.finished_flags.all())
        self.done = not (
            self._improvable
            and not (all_finished and self.early_stopping is True)
            and not bool(hits.all())
        )
        return next_beams

    def _update_heuristic(self, gen_len: int) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = gen_len
        best_possible = self.running_scores[0] / (best_len**self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), NEG)
        self._improvable = self._improvable and bool((best_possible > worst).any())

    def results(self, n: int) -> list[BeamHypothesis]:
        """The best ``n`` finished hypotheses, best first."""
        out = []
        for i in range(min(n, self.width)):
            toks = self.finished_tokens[i]
            if toks is None or not bool(self.finished_flags[i]):
                continue
            hit = bool(toks) and toks[-1] in self.stop_ids
            out.append(BeamHypothesis(toks, float(self.finished_scores[i]), hit))
        return out

    def give_up(self, outputs: Sequence[list[int]]) -> None:
        """End early (KV capacity): live beams become hypotheses if nothing finished yet."""
        if not bool(self.finished_flags.any()) and outputs:
            lp = self.length_penalty
            n = max(len(outputs[0]), 1)
            for i, toks in enumerate(outputs[: self.width]):
                self.finished_tokens[i] = list(toks)
                self.finished_scores[i] = float(self.running_scores[i]) / n**lp
                self.finished_flags[i] = True
        self.done = True
