"""The batched sampler against a row-by-row reference written from the sampling rules.

Same seeds give the same tokens and logprobs for every option (greedy, temperature, top-k,
top-p, min-p, banned ids, logprobs, seeded and unseeded rows, mixed batches). On CUDA the
same batch runs on the device and must agree with the host for greedy rows and seeded rows.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvstore.requests.sampling_params import SamplingParams
from worker.engine.sampler import SampleSpec, sample

VOCAB = 97


def reference_row(logits, spec: SampleSpec, default: torch.Generator):
    """One row by the rules, without batching tricks."""
    p = spec.params
    row = logits.clone()
    counts = torch.zeros(VOCAB)
    for t in spec.output_ids:
        counts[t] += 1
    seen = set(spec.prompt_ids) | set(spec.output_ids)
    for t in seen:
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if spec.banned:
        row[list(spec.banned)] = float("-inf")
    if p.is_greedy:
        return int(row.argmax())
    row = row / p.temperature
    k = min(p.top_k, VOCAB) if p.top_k else VOCAB
    if k < VOCAB or p.top_p < 1.0:
        asc, order = row.sort(descending=False)
        asc = asc.masked_fill(asc < asc[VOCAB - k], float("-inf"))
        cum = asc.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p.top_p
        drop[-1] = False
        asc = asc.masked_fill(drop, float("-inf"))
        row = torch.empty_like(row).scatter_(0, order, asc)
    probs = row.softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < probs.max() * p.min_p, 0.0)
    race = torch.empty_like(probs).exponential_(generator=spec.generator or default)
    return int((probs / race).argmax())


def random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 1, 5, 40]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        seed=rng.choice([None, rng.randrange(1000)]),
        logprobs=rng.choice([None, None, 0, 3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.7, 2.0]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        max_tokens=4,
    )


def make_specs(params, rng: random.Random, device="cpu"):
    specs = []
    for i, p in enumerate(params):
        gen = None if p.seed is None else torch.Generator(device).manual_seed(p.seed + i)
        banned = tuple(rng.sample(range(VOCAB), rng.choice([0, 0, 1, 4])))
        history = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 3, 9]))]
        split = rng.randrange(len(history) + 1)
        specs.append(SampleSpec(p, gen, banned, history[:split], history[split:]))
    return specs


@pytest.mark.parametrize("seed", range(12))
def test_batched_sampler_equals_row_reference(seed):
    rng = random.Random(seed)
    rows = rng.randrange(1, 24)
    params = [random_params(rng) for _ in range(rows)]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    got, lps = sample(
        logits, make_specs(params, random.Random(seed)), torch.Generator().manual_seed(7)
    )
    ref_default = torch.Generator().manual_seed(7)
    ref_specs = make_specs(params, random.Random(seed))
    want = [reference_row(logits[i], s, ref_default) for i, s in enumerate(ref_specs)]
    assert got == want
    raw_lp = logits.log_softmax(-1)
    for i, (p, lp) in enumerate(zip(params, lps, strict=True)):
        if p.logprobs is None:
            assert lp is None
            continue
        assert lp.token_id == got[i]
        assert lp.logprob == pytest.approx(float(raw_lp[i, got[i]]), abs=1e-6)
        top = raw_lp[i].topk(p.logprobs)
        assert [t for t, _ in lp.top] == top.indices.tolist()


def test_banned_tokens_never_sampled():
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 10.0
    specs = [
        SampleSpec(SamplingParams(temperature=0.0), None, (5,)),
        SampleSpec(SamplingParams(temperature=1.0, seed=1), torch.Generator().manual_seed(1), (5,)),
        SampleSpec(SamplingParams(temperature=0.0), None, ()),
    ]
    tokens, _ = sample(logits, specs, torch.Generator().manual_seed(0))
    assert tokens[0] != 5 and tokens[1] != 5 and tokens[2] == 5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_sampling_matches_host_for_greedy_and_seeded_rows():
    rng = random.Random(3)
    params = [random_params(rng) for _ in range(32)]
    params = [p for p in params if p.is_greedy or p.seed is not None]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3))
    host, _ = sample(logits, make_specs(params, random.Random(1)), torch.Generator())
    dev, _ = sample(logits.cuda(), make_specs(params, random.Random(1)), torch.Generator())
    assert dev == host
