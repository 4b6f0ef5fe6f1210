"""Logits adjusted before sampling, for the rows that ask: presence, frequency and
repetition penalties (OpenAI's and vLLM's definitions), then OpenAI's ``logit_bias``, then
vLLM's ``allowed_token_ids`` and each row's banned ids. The penalties' token counts come
from the engine's device tables (``penalties.py``) or, without them, are counted here from
each row's ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.engine.host_copies import to_device

if TYPE_CHECKING:
    from worker.engine.sampler import SampleSpec

# finite logits after penalties, even divided by GREEDY_EPS (float32 max is ~3.4e38)
_LOGIT_BOUND = 1e30


@dataclass(slots=True)
class PenaltyRows:
    """Token counts of a batch's rows that set penalties, in row order, on the logits'
    device (the engine keeps them across steps: ``worker.engine.penalties``)."""

    output: torch.Tensor  # [rows, vocab] float32: occurrences of each token in the output
    prompt_seen: torch.Tensor  # [rows, vocab] bool: the token is in the prompt (read only
    # for rows with a repetition penalty)


def token_counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), vocab]`` occurrence counts of each row's ids (one padded copy over)."""
    width = max((len(r) for r in rows), default=0)
    ids = to_device([list(r) + [vocab] * (width - len(r)) for r in rows], torch.long, device)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32, device=device)
    if width:
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]  # the last column took the padding


def _apply_penalties(
    logits: torch.Tensor, specs: Sequence[SampleSpec], counts: PenaltyRows | None
) -> torch.Tensor:
    rows = [i for i, s in enumerate(specs) if s.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    chosen = [specs[i] for i in rows]
    idx = to_device(rows, torch.long, device)
    sub = logits.index_select(0, idx)
    if counts is not None:
        assert counts.output.shape == sub.shape, (counts.output.shape, sub.shape)
        out_counts = counts.output
    else:
        out_counts = token_counts([s.output_ids for s in chosen], vocab, device)
    if any(s.params.repetition_penalty != 1.0 for s in chosen):
        if counts is not None:
            in_prompt = counts.prompt_seen
        else:
            in_prompt = token_counts([s.prompt_ids for s in chosen], vocab, device) > 0
        seen = (out_counts > 0) | in_prompt
        rep = to_device([s.params.repetition_penalty for s in chosen], sub.dtype, device)
        rep = rep.unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device([s.params.frequency_penalty for s in chosen], sub.dtype, device)
    pres = to_device([s.params.presence_penalty for s in chosen], sub.dtype, device)
    sub = sub - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * (out_counts > 0).to(sub.dtype)
    # a tiny repetition penalty divides a logit into inf (softmax of infs is NaN, and the
    # sample an arbitrary token): clamp so that even / temperature stays finite
    sub = sub.clamp(-_LOGIT_BOUND, _LOGIT_BOUND)
    return logits.index_copy(0, idx, sub)


def adjust(
    logits: torch.Tensor, specs: Sequence[SampleSpec], counts: PenaltyRows | None
) -> torch.Tensor:
    """Penalties, then OpenAI's ``logit_bias`` (added; logprobs stay the model's own), then
    every id outside a row's ``allowed_token_ids`` and the banned ids of each row masked."""
    device = logits.device
    logits = _apply_penalties(logits, specs, counts)
    biased = [(i, t, b) for i, s in enumerate(specs) for t, b in s.params.logit_bias]
    if biased:
        rows, cols, bias = zip(*biased, strict=True)
        logits = logits.index_put(
            tuple(to_device([list(rows), list(cols)], torch.long, device)),
            to_device(list(bias), logits.dtype, device),
            accumulate=True,
        )
    logits = _keep_allowed(logits, specs)
    banned_rows = [i for i, s in enumerate(specs) for _ in s.banned]
    if banned_rows:
        cells = [banned_rows, [t for s in specs for t in s.banned]]
        logits = logits.index_put(
            tuple(to_device(cells, torch.long, device)),
            torch.tensor(float("-inf"), dtype=logits.dtype, device=device),
        )
    return logits


def _keep_allowed(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """-inf on every id a row's ``allowed_token_ids`` leaves out (rows without: as they are)."""
    rows = [i for i, s in enumerate(specs) if s.params.allowed_token_ids]
    if not rows:
        return logits
    device = logits.device
    ids = [s.params.allowed_token_ids for s in (specs[i] for i in rows)]
    cells = [[k for k, row_ids in enumerate(ids) for _ in row_ids], [t for r in ids for t in r]]
    keep = torch.zeros((len(rows), logits.shape[-1]), dtype=torch.bool, device=device)
    keep.index_put_(tuple(to_device(cells, torch.long, device)), torch.tensor(True, device=device))
    idx = to_device(rows, torch.long, device)
    kept = logits.index_select(0, idx).masked_fill_(~keep, float("-inf"))
    return logits.index_copy(0, idx, kept)
