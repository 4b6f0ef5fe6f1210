"""Logits -> tokens for a batch of sequences with per-row parameters, on the logits' device.

Greedy rows take the argmax. Random rows go through temperature, top-k, top-p and min-p,
then draw with the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw
from ``p``), where each seeded sequence draws its ``E`` from its own ``torch.Generator``, which
the output processor seeds for each output position (``Sequence.seed_draw``, ~4 us a row): the
tokens of a seeded request therefore depend neither on what else is in the batch nor on where
it ran before (a stream moved mid-way draws what the uninterrupted run would have).
Presence, frequency and repetition penalties (OpenAI's and vLLM's definitions), ``logit_bias``
and banned ids adjust the logits first, for every row that sets them, greedy rows included
(``logit_adjust.py``); the engine passes the penalties' token counts from device tables it
updates incrementally (``penalties.py``).
Logprobs are those of the raw model distribution (before penalties, temperature and filters).
A row whose raw logits are not all finite (a model or adapter that overflowed) samples no
token: its token is ``None`` and its logprobs too, so no NaN ever reaches a client.

Every step's work is batched tensor ops on the device that produced the logits (a GPU in
production): per-row parameters go over in small copies, and only the sampled ids (plus the
logprobs a request asked for) come back, through pinned memory with one synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.requests.outputs import TokenLogprob
from kvstore.requests.sampling_params import SamplingParams
from worker.attention import native
from worker.engine.host_copies import to_device, to_host
from worker.engine.logit_adjust import PenaltyRows, adjust

if TYPE_CHECKING:
    from worker.engine.grammar_masks import TokenMask


@dataclass(slots=True)
class SampleSpec:
    """One row to sample."""

    params: SamplingParams  # the request's parameters
    generator: torch.Generator | None  # private RNG (seeded requests), else the engine's
    banned: tuple[int, ...] = ()  # token ids masked out (EOS / stop ids before min_tokens)
    # read only when the request sets penalties and ``sample`` is given no PenaltyRows
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    # facts of ``params`` read for every row of every step, taken once
    greedy: bool = field(init=False)
    penalized: bool = field(init=False)

    def __post_init__(self) -> None:
        self.greedy = self.params.is_greedy
        self.penalized = self.params.has_penalties


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` [rows, n]: whether it is all finite. A row's sum is NaN or infinite
    when one value is (a sum is one pass, 30x cheaper on the CPU than ``isfinite().all()``);
    finite logits large enough for their sum to overflow (~1e34) count as broken too."""
    return x.sum(dim=-1).isfinite()


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``; on the CPU through the native kernel (torch's walks a row one
    element at a time: ~0.9 ms for a greedy step of 128 rows over an 8k vocabulary)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
        kernels = native.load_kernels()
        if kernels is not None and x.stride(1) == 1:
            return kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [min(s.params.top_k, vocab) if s.params.top_k else vocab for s in specs]
    ps = [s.params.top_p for s in specs]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = to_device(ks, torch.long, logits.device)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    p = to_device(ps, logits.dtype, logits.device)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def _race(
    probs: torch.Tensor, specs: Sequence[SampleSpec], default: torch.Generator
) -> torch.Tensor:
    """``E ~ Exp(1)`` per cell. A seeded row draws from its own generator (on that generator's
    device, so a seed gives the same tokens whatever the batch); unseeded rows share the
    engine's, drawn in one call when it lives on another device than the logits."""
    race = torch.empty_like(probs)
    device = probs.device
    shared: list[int] = []
    for i, spec in enumerate(specs):
        gen = spec.generator or default
        if gen.device == device:
            race[i].exponential_(generator=gen)
        elif spec.generator is not None:
            row = torch.empty(probs.shape[-1], dtype=probs.dtype, device=gen.device)
            race[i].copy_(row.exponential_(generator=gen), non_blocking=True)
        else:
            shared.append(i)
    if shared:
        seed = int(torch.randint(2**62, (), generator=default))
        local = torch.Generator(device=device).manual_seed(seed)
        idx = to_device(shared, torch.long, device)
        draw = torch.empty((len(shared), probs.shape[-1]), dtype=probs.dtype, device=device)
        race.index_copy_(0, idx, draw.exponential_(generator=local))
    return race


def _sample_random(
    logits: torch.Tensor, specs: Sequence[SampleSpec], default: torch.Generator
) -> torch.Tensor:
    temps = to_device([s.params.temperature for s in specs], logits.dtype, logits.device)
    logits = _apply_top_k_top_p(logits / temps.unsqueeze(1), specs)
    probs = logits.softmax(dim=-1)
    if any(s.params.min_p > 0 for s in specs):
        min_p = to_device([s.params.min_p for s in specs], probs.dtype, probs.device)
        cutoff = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < cutoff, 0.0)
    return _argmax(probs / _race(probs, specs, default))


def sample(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    default: torch.Generator,
    counts: PenaltyRows | None = None,
    mask: TokenMask | None = None,
) -> tuple[list[int | None], list[TokenLogprob | None]]:
    """One token per row of ``logits`` [rows, vocab] (float32, on any device); returns tokens
    and logprobs on the host (``None`` for a row with non-finite logits). ``counts``: the
    token counts of the rows that set penalties; without them they are counted here from each
    spec's ``prompt_ids`` and ``output_ids``. ``mask``: the tokens a grammar allows in its
    rows (``worker.engine.structured``)."""
    assert logits.shape[0] == len(specs), (logits.shape, len(specs))
    device = logits.device
    raw = logits
    # one pass over the rows for what they ask (the usual batch asks nothing special)
    greedy: list[int] = []
    rand: list[int] = []
    want: list[int] = []
    special = False  # a row with penalties, logit_bias, allowed or banned ids
    for i, s in enumerate(specs):
        (greedy if s.greedy else rand).append(i)
        p = s.params
        if p.logprobs is not None:
            want.append(i)
        if s.penalized or s.banned or p.logit_bias or p.allowed_token_ids:
            special = True
    if special:
        logits = adjust(logits, specs, counts)
    if mask is not None and mask.rows is None:
        logits = logits.masked_fill(mask.banned, float("-inf"))
    elif mask is not None:
        masked = logits.index_select(0, mask.rows).masked_fill_(mask.banned, float("-inf"))
        logits = logits.index_copy(0, mask.rows, masked)
    if not rand:
        tokens = _argmax(logits)
    elif not greedy:
        tokens = _sample_random(logits, specs, default)
    else:
        tokens = torch.empty(len(specs), dtype=torch.long, device=device)
        g_idx = to_device(greedy, torch.long, device)
        r_idx = to_device(rand, torch.long, device)
        tokens.index_copy_(0, g_idx, _argmax(logits.index_select(0, g_idx)))
        picked = _sample_random(logits.index_select(0, r_idx), [specs[i] for i in rand], default)
        tokens.index_copy_(0, r_idx, picked)
    # -1 marks a row with non-finite logits (read back with the tokens: no extra sync)
    tokens = torch.where(finite_rows(raw), tokens, -1)
    if not want:
        (host_tokens,) = to_host(tokens)
        return [t if t >= 0 else None for t in host_tokens.tolist()], [None] * len(specs)
    w_idx = to_device(want, torch.long, device)
    lp = raw.index_select(0, w_idx).log_softmax(dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, w_idx).clamp(min=0).unsqueeze(1)).squeeze(1)
    top_v, top_i = lp.topk(max(specs[i].params.logprobs for i in want))
    host_tokens, chosen, top_v, top_i = to_host(tokens, chosen, top_v, top_i)
    token_list: list[int | None] = [t if t >= 0 else None for t in host_tokens.tolist()]
    chosen_l, top_vl, top_il = chosen.tolist(), top_v.tolist(), top_i.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(specs)
    for row, i in enumerate(want):
        tok = token_list[i]
        if tok is None:
            continue
        k = specs[i].params.logprobs
        top = tuple(zip(top_il[row][:k], top_vl[row][:k], strict=True)) if k else ()
        logprobs[i] = TokenLogprob(tok, chosen_l[row], top)
    return token_list, logprobs


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """Each row's log-probability of its target token and its k most likely alternatives
    (prompt logprobs: row i holds the logits that predict ``targets[i]``)."""
    assert logits.shape[0] == len(targets), (logits.shape, len(targets))
    lp = logits.log_softmax(dim=-1)
    idx = to_device(list(targets), torch.long, logits.device)
    chosen = lp.gather(1, idx.unsqueeze(1)).squeeze(1)
    top_v, top_i = lp.topk(k) if k else (chosen[:0], idx[:0])
    chosen_h, top_vh, top_ih = to_host(chosen, top_v, top_i)
    values, alt_v, alt_i = chosen_h.tolist(), top_vh.tolist(), top_ih.tolist()
    return [
        TokenLogprob(t, v, tuple(zip(alt_i[i], alt_v[i], strict=True)) if k else ())
        for i, (t, v) in enumerate(zip(targets, values, strict=True))
    ]
