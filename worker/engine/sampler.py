"""Logits -> tokens for a batch of sequences with per-row parameters.

Greedy rows take the argmax. Random rows go through temperature, top-k, top-p and min-p,
then draw with the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw
from ``p``), where each seeded sequence draws its ``E`` from its own ``torch.Generator``: the
tokens of a seeded request therefore do not depend on what else is in the batch.
Logprobs are those of the raw model distribution (before temperature and filters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.outputs import TokenLogprob
from worker.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleSpec:
    """One row to sample."""

    params: SamplingParams  # the request's parameters
    generator: torch.Generator | None  # private RNG (seeded requests), else the engine's
    banned: tuple[int, ...] = ()  # token ids masked out (EOS / stop ids before min_tokens)


def _apply_top_k_top_p(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [min(s.params.top_k, vocab) if s.params.top_k else vocab for s in specs]
    ps = [s.params.top_p for s in specs]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = torch.tensor(ks, device=logits.device)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    p = torch.tensor(ps, dtype=logits.dtype, device=logits.device)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def _sample_random(
    logits: torch.Tensor, specs: Sequence[SampleSpec], default: torch.Generator
) -> torch.Tensor:
    temps = torch.tensor([s.params.temperature for s in specs], dtype=logits.dtype)
    logits = _apply_top_k_top_p(logits / temps.unsqueeze(1), specs)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([s.params.min_p for s in specs], dtype=probs.dtype)
    if bool((min_p > 0).any()):
        cutoff = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < cutoff, 0.0)
    race = torch.empty_like(probs)
    for i, spec in enumerate(specs):
        race[i].exponential_(generator=spec.generator or default)
    return (probs / race).argmax(dim=-1)


def sample(
    logits: torch.Tensor, specs: Sequence[SampleSpec], default: torch.Generator
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of ``logits`` [rows, vocab] (float32); returns tokens and logprobs."""
    assert logits.shape[0] == len(specs), (logits.shape, len(specs))
    raw = logits
    if any(s.banned for s in specs):
        logits = logits.clone()
        for i, spec in enumerate(specs):
            if spec.banned:
                logits[i, list(spec.banned)] = float("-inf")
    tokens = torch.empty(len(specs), dtype=torch.long)
    greedy = [i for i, s in enumerate(specs) if s.params.is_greedy]
    rand = [i for i, s in enumerate(specs) if not s.params.is_greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    if rand:
        tokens[rand] = _sample_random(logits[rand], [specs[i] for i in rand], default)
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(specs)
    want = [i for i, s in enumerate(specs) if s.params.logprobs is not None]
    if want:
        lp = raw[want].log_softmax(dim=-1)
        for row, i in enumerate(want):
            k = specs[i].params.logprobs
            top = lp[row].topk(k) if k else None
            logprobs[i] = TokenLogprob(
                token_list[i],
                float(lp[row, token_list[i]]),
                tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else (),
            )
    return token_list, logprobs
