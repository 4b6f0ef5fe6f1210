"""Logits -> tokens for a batch of sequences with per-row parameters, on the logits' device.

Greedy rows take the argmax. Random rows go through temperature, top-k, top-p and min-p,
then draw with the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw
from ``p``), where each seeded sequence draws its ``E`` from its own ``torch.Generator``: the
tokens of a seeded request therefore do not depend on what else is in the batch.
Presence, frequency and repetition penalties (OpenAI's and vLLM's definitions) adjust the
logits first, for every row that sets them, greedy rows included; the engine passes their
token counts from device tables it updates incrementally (``penalties.py``).
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

from kvstore.blocks.outputs import TokenLogprob
from kvstore.blocks.sampling_params import SamplingParams
from worker.attention import native

if TYPE_CHECKING:
    from worker.engine.grammar_masks import TokenMask

# finite logits after penalties, even divided by GREEDY_EPS (float32 max is ~3.4e38)
_LOGIT_BOUND = 1e30


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


@dataclass(slots=True)
class PenaltyRows:
    """Token counts of a batch's rows that set penalties, in row order, on the logits'
    device (the engine keeps them across steps: ``worker.engine.penalties``)."""

    output: torch.Tensor  # [rows, vocab] float32: occurrences of each token in the output
    prompt_seen: torch.Tensor  # [rows, vocab] bool: the token is in the prompt (read only
    # for rows with a repetition penalty)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` in one (non-blocking, pinned on CUDA) copy."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device tensors on the host with one synchronisation (pinned buffers on CUDA)."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    out = []
    for t in tensors:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        out.append(buf)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out


def _token_counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), vocab]`` occurrence counts of each row's ids (one padded copy over)."""
    width = max((len(r) for r in rows), default=0)
    ids = to_device([list(r) + [vocab] * (width - len(r)) for r in rows], torch.long, device)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32, device=device)
    if width:
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]  # the last column took the padding


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
        out_counts = _token_counts([s.output_ids for s in chosen], vocab, device)
    if any(s.params.repetition_penalty != 1.0 for s in chosen):
        if counts is not None:
            in_prompt = counts.prompt_seen
        else:
            in_prompt = _token_counts([s.prompt_ids for s in chosen], vocab, device) > 0
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


def _adjust(
    logits: torch.Tensor, specs: Sequence[SampleSpec], counts: PenaltyRows | None
) -> torch.Tensor:
    """Penalties, then OpenAI's ``logit_bias`` (added; logprobs stay the model's own), then
    the banned ids of each row."""
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
    banned_rows = [i for i, s in enumerate(specs) for _ in s.banned]
    if banned_rows:
        cells = [banned_rows, [t for s in specs for t in s.banned]]
        logits = logits.index_put(
            tuple(to_device(cells, torch.long, device)),
            torch.tensor(float("-inf"), dtype=logits.dtype, device=device),
        )
    return logits


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
    special = False  # a row with penalties, logit_bias or banned ids
    for i, s in enumerate(specs):
        (greedy if s.greedy else rand).append(i)
        p = s.params
        if p.logprobs is not None:
            want.append(i)
        if s.penalized or s.banned or p.logit_bias:
            special = True
    if special:
        logits = _adjust(logits, specs, counts)
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
        (host_tokens,) = _to_host(tokens)
        return [t if t >= 0 else None for t in host_tokens.tolist()], [None] * len(specs)
    w_idx = to_device(want, torch.long, device)
    lp = raw.index_select(0, w_idx).log_softmax(dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, w_idx).clamp(min=0).unsqueeze(1)).squeeze(1)
    top_v, top_i = lp.topk(max(specs[i].params.logprobs for i in want))
    host_tokens, chosen, top_v, top_i = _to_host(tokens, chosen, top_v, top_i)
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
    chosen_h, top_vh, top_ih = _to_host(chosen, top_v, top_i)
    values, alt_v, alt_i = chosen_h.tolist(), top_vh.tolist(), top_ih.tolist()
    return [
        TokenLogprob(t, v, tuple(zip(alt_i[i], alt_v[i], strict=True)) if k else ())
        for i, (t, v) in enumerate(zip(targets, values, strict=True))
    ]
