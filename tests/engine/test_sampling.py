"""Sampler semantics on the fake model: logprobs, filters, seeds (exact where possible)."""

from __future__ import annotations

import torch

from tests.engine.fakes import FakeExecutor, context_logits, reference_generate
from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.sampler import SampleSpec, sample

PROMPT = [5, 9, 13, 17, 21, 25]


def make(**cfg) -> Engine:
    return Engine(FakeExecutor(256, 4), EngineConfig(block_size=4, max_model_len=256, **cfg))


def tokens(engine: Engine, params: SamplingParams, prompt=PROMPT) -> list[int]:
    return engine.generate([prompt], params)[0].completions[0].token_ids


def test_logprobs_are_those_of_the_raw_distribution() -> None:
    engine = make()
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=3, ignore_eos=True)
    comp = engine.generate([PROMPT], params)[0].completions[0]
    ctx = list(PROMPT)
    total = 0.0
    for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True):
        ref = context_logits(ctx, 64).log_softmax(-1)
        top = ref.topk(3)
        assert lp.token_id == tok
        assert abs(lp.logprob - float(ref[tok])) < 1e-5
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(abs(v - r) < 1e-5 for (_, v), r in zip(lp.top, top.values.tolist(), strict=True))
        total += lp.logprob
        ctx.append(tok)
    assert abs(comp.cumulative_logprob - total) < 1e-4


def test_filters_that_leave_one_token_are_greedy() -> None:
    engine = make()
    greedy = reference_generate(PROMPT, 10, ignore_eos=True)
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10, ignore_eos=True),
    ):
        assert tokens(engine, params) == greedy, params


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    best = set(logits[0].topk(3).indices.tolist())
    seen = set()
    g = torch.Generator().manual_seed(1)
    spec = SampleSpec(SamplingParams(temperature=5.0, top_k=3), g)
    for _ in range(200):
        toks, _ = sample(logits, [spec], g)
        seen.add(toks[0])
    assert seen == best  # high temperature: all three show up, nothing else does


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 3] = 10.0
    g = torch.Generator().manual_seed(0)
    specs = [
        SampleSpec(SamplingParams(temperature=0), None, (3,)),
        SampleSpec(SamplingParams(temperature=1.0), g, (3, 4)),
    ]
    for _ in range(50):
        toks, _ = sample(logits, specs, g)
        assert toks[0] != 3 and toks[1] not in (3, 4)


def test_seed_reproduces_regardless_of_batch_and_unseeded_differs() -> None:
    engine = make()
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = tokens(engine, params)
    crowd = engine.generate(
        [[7, 8], PROMPT, [30, 31, 32, 33, 34]],
        [SamplingParams(temperature=1.0, max_tokens=20), params, SamplingParams(n=3, seed=1)],
    )
    assert crowd[1].completions[0].token_ids == alone
    assert tokens(engine, SamplingParams(temperature=1.0, seed=43, max_tokens=12)) != alone
    assert_no_blocks_in_use(engine)


def test_latency_metrics_count_every_token() -> None:
    engine = make()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.generate([PROMPT, PROMPT[:3], [40, 41, 42, 43, 44, 45, 46]], params)
    m = engine.metrics()
    assert m.ttft.count == 3 and m.itl.count == 3 * 4
    assert 0 < m.ttft.p50 <= m.ttft.p99 and m.itl.p50 > 0
    assert m.generation_tokens == 15 and m.num_finished == 3 and m.prompt_tokens == 16


def test_penalties_reach_the_sampler_through_the_engine() -> None:
    """Greedy with penalties equals stepping the fake model's logits with the penalty rules."""
    engine = make()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=1.5,
        repetition_penalty=1.3,
    )
    got = tokens(engine, params)
    ctx, out = list(PROMPT), []
    for _ in range(12):
        logits = context_logits(ctx, 64).clone()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=64).float()
        for t in set(ctx):
            logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
        logits -= 1.5 * counts + 0.5 * (counts > 0).float()
        out.append(int(logits.argmax()))
        ctx.append(out[-1])
    assert got == out
    assert got != tokens(make(), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))


def test_extreme_repetition_penalty_keeps_the_logits_finite() -> None:
    """repetition_penalty at its smallest (1e-45, a float32 denormal: allowed, (0, 10])
    divides a seen token's positive logit into inf; softmax of two infs is NaN, and the
    sample was then an arbitrary token. Clamped, the seen tokens win, as the penalty asks."""
    logits = torch.full((1, 64), -1.0)
    logits[0, 7] = logits[0, 9] = 2.0  # seen (in the prompt), positive
    logits[0, 30] = 5.0  # unseen, the best without the penalty
    g = torch.Generator().manual_seed(0)
    for temperature in (0.0, 1.0, 1e-4):
        spec = SampleSpec(
            SamplingParams(temperature=temperature, repetition_penalty=1e-45),
            g,
            prompt_ids=(7, 9),
        )
        picked = {sample(logits, [spec], g)[0][0] for _ in range(40)}
        assert picked <= {7, 9}, (temperature, picked)
