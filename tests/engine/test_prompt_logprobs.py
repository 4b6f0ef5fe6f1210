"""Prompt logprobs (log-likelihood scoring, as lm-eval asks for with echo + logprobs):
every prompt position's logprob and alternatives equal transformers' log-softmax over the
same prompt, across chunked prefill, for a prompt whose blocks are already cached, and with
the sampled tokens' own logprobs unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, InvalidRequest, SamplingParams

_rng = random.Random(1)
PROMPT = [_rng.randrange(5, 512) for _ in range(45)]  # three prefill chunks of 16


def test_prompt_logprobs_equal_transformers(tiny_dir, hf_model) -> None:
    engine = Engine.from_model_dir(
        tiny_dir,
        EngineConfig(
            num_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            long_prefill_token_threshold=16,
        ),
    )
    with torch.no_grad():
        ref = hf_model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0, prompt_logprobs=2)
    plain = SamplingParams(temperature=0, max_tokens=3, logprobs=0)
    (warm,) = engine.generate([PROMPT], plain)  # caches the prompt's blocks
    assert engine.generate([PROMPT], plain)[0].usage.cached_tokens > 0  # a plain rerun hits
    first, again = (engine.generate([PROMPT], params)[0] for _ in range(2))
    for res in (first, again):
        lps = res.prompt_logprobs
        assert lps is not None and len(lps) == len(PROMPT) and lps[0] is None
        for i in range(1, len(PROMPT)):
            assert lps[i].token_id == PROMPT[i]
            assert lps[i].logprob == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
            assert [t for t, _ in lps[i].top] == ref[i - 1].topk(2).indices.tolist()
        assert res.usage.cached_tokens == 0  # computed whole, though its blocks were cached
        # the completion is the one without prompt logprobs, token for token
        assert res.completions[0].token_ids == warm.completions[0].token_ids
        got = [x.logprob for x in res.completions[0].logprobs]
        assert got == pytest.approx([x.logprob for x in warm.completions[0].logprobs], abs=1e-4)
    assert warm.prompt_logprobs is None
    assert_no_blocks_in_use(engine)


def test_prompt_logprobs_are_checked() -> None:
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(beam_width=2, prompt_logprobs=1)
