"""Logits that are not finite (a model or adapter that overflowed) fail their own request:
no token is sampled from them and no NaN reaches an output; the batch's other requests go on."""

from __future__ import annotations

import math

import pytest

from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.model.build_tiny_lora import build_tiny_lora

PROMPT = [7, 93, 41, 250, 18, 301, 77, 5, 140, 66, 12, 480]
NEW = 6


def test_non_finite_logits_fail_their_request_alone(tiny_dir, tmp_path) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    engine = Engine.from_model_dir(
        tiny_dir, EngineConfig(num_blocks=64, lora_adapters={"x": str(a)})
    )
    # an adapter that overflows on some input (registration bounds it for unit-size inputs
    # only): its weights turn NaN after registration, before it reaches a slot
    engine.executor.adapter("x").weights[(1, "down_proj")][1].fill_(math.nan)
    kw = dict(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=2)
    alone = engine.generate([PROMPT], SamplingParams(**kw))[0].completions[0]
    greedy, sampled, base = engine.generate(
        [PROMPT, PROMPT, PROMPT],
        [
            SamplingParams(**kw, lora="x"),
            SamplingParams(**{**kw, "temperature": 0.8}, seed=1, lora="x", presence_penalty=0.5),
            SamplingParams(**kw),
        ],
    )
    for res in (greedy, sampled):
        assert res.error is not None and "non-finite logits" in res.error, res.error
        assert "'x'" in res.error
        assert all(not c.token_ids for c in res.completions)  # nothing sampled from NaN
    assert base.error is None
    assert base.completions[0].token_ids == alone.token_ids  # its batch-mate is untouched
    assert [lp.logprob for lp in base.completions[0].logprobs] == pytest.approx(
        [lp.logprob for lp in alone.logprobs]
    )
    beam = engine.generate([PROMPT], SamplingParams(beam_width=2, max_tokens=3, lora="x"))[0]
    assert beam.error is not None and "non-finite logits" in beam.error
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_sampler_samples_nothing_from_a_non_finite_row(bad) -> None:
    import torch

    from worker.engine.sampler import SampleSpec, sample

    logits = torch.randn(3, 50)
    logits[1, 7] = bad
    specs = [
        SampleSpec(SamplingParams(temperature=0, logprobs=2), None),
        SampleSpec(SamplingParams(temperature=0, logprobs=2), None),
        SampleSpec(SamplingParams(temperature=0.7, seed=3), torch.Generator().manual_seed(3)),
    ]
    tokens, logprobs = sample(logits, specs, torch.Generator().manual_seed(0))
    assert tokens[1] is None and logprobs[1] is None
    assert tokens[0] == int(logits[0].argmax()) and logprobs[0].token_id == tokens[0]
    assert math.isfinite(logprobs[0].logprob) and tokens[2] is not None
