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

Finished hypotheses are RANKED in log space: for a log-probability sum ``s < 0`` the score
``s / len ** p`` orders like ``p * log(len) - log(-s)``, which cannot overflow for any
length penalty (``len ** p`` does: ``9 ** 2000`` raises ``OverflowError``), and an empty
slot is an explicit flag, not a sentinel score a real hypothesis could fall below (with a
negative penalty a real score can be far below -1e9). The reported score is computed from the
same logarithms in float64, clamped to the finite range.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

NEG = -1.0e9  # transformers' "never pick this" offset for running beams that hit a stop
_INF = float("inf")


def rank_key(logprob_sum: torch.Tensor, length: int, length_penalty: float) -> torch.Tensor:
    """Monotone in ``logprob_sum / length ** length_penalty`` (log-prob sums are <= 0), float64,
    finite or +-inf but never an overflow: +inf for a sum of 0, -inf for an impossible one."""
    lp = logprob_sum.double()
    return length_penalty * math.log(length) - torch.log(-lp)


def beam_score(logprob_sum: float, length: int, length_penalty: float) -> float:
    """``logprob_sum / length ** length_penalty`` without overflow, clamped to finite floats."""
    if logprob_sum >= 0.0:
        return 0.0
    log_mag = math.log(-logprob_sum) - length_penalty * math.log(length)
    big = sys.float_info.max
    return -math.exp(log_mag) if log_mag < math.log(big) else -big


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
        # finished slots, best first: rank key (see rank_key), logprob sum, length, flag
        self.finished_keys = torch.full((width,), -_INF, dtype=torch.float64)
        self.finished_sums = torch.zeros(width)
        self.finished_lens = [1] * width
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

        # an impossible candidate (-inf: every token banned) never counts as finished
        just_finished = hits & (torch.arange(k) < self.width) & (top_lp > -_INF)
        if bool(self.finished_flags.all()) and self.early_stopping is True:
            just_finished[:] = False
        if not self._improvable:
            just_finished[:] = False
        m = min(self.width, k)  # only the first width candidates can finish
        keys = rank_key(top_lp[:m], gen_len + 1, self.length_penalty)
        merged_keys = torch.cat((self.finished_keys, torch.where(just_finished[:m], keys, -_INF)))
        merged_flags = torch.cat((self.finished_flags, just_finished[:m]))
        # best first; an empty slot ranks below every finished hypothesis, whatever its score
        flags_l, keys_l = merged_flags.tolist(), merged_keys.tolist()
        order = sorted(range(len(keys_l)), key=lambda i: (not flags_l[i], -keys_l[i], i))
        order = order[: self.width]
        merged_sums = torch.cat((self.finished_sums, top_lp[:m]))
        merged_lens = self.finished_lens + [gen_len + 1] * m
        merged_tokens = self.finished_tokens + [
            [*outputs[p], t] for p, t in zip(parents[:m], tokens[:m], strict=True)
        ]
        sel = torch.tensor(order)
        self.finished_keys = merged_keys[sel]
        self.finished_sums = merged_sums[sel]
        self.finished_flags = merged_flags[sel]
        self.finished_lens = [merged_lens[i] for i in order]
        self.finished_tokens = [merged_tokens[i] for i in order]

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
        if not bool(self.finished_flags.all()):
            return  # an empty slot: a live beam can always still improve the result
        best_possible = rank_key(self.running_scores[:1], best_len, self.length_penalty)[0]
        self._improvable = self._improvable and bool(best_possible > self.finished_keys.min())

    def results(self, n: int) -> list[BeamHypothesis]:
        """The best ``n`` finished hypotheses, best first."""
        out = []
        for i in range(min(n, self.width)):
            toks = self.finished_tokens[i]
            if toks is None or not bool(self.finished_flags[i]):
                continue
            hit = bool(toks) and toks[-1] in self.stop_ids
            score = beam_score(
                float(self.finished_sums[i]), self.finished_lens[i], self.length_penalty
            )
            out.append(BeamHypothesis(toks, score, hit))
        return out

    def give_up(self, outputs: Sequence[list[int]]) -> None:
        """End early (KV capacity): live beams become hypotheses if nothing finished yet."""
        if not bool(self.finished_flags.any()) and outputs:
            n = max(len(outputs[0]), 1)
            for i, toks in enumerate(outputs[: self.width]):
                self.finished_tokens[i] = list(toks)
                self.finished_sums[i] = self.running_scores[i]
                self.finished_lens[i] = n
                self.finished_keys[i] = rank_key(
                    self.running_scores[i : i + 1], n, self.length_penalty
                )[0]
                self.finished_flags[i] = True
        self.done = True
