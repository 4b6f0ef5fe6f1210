"""vLLM's ``allowed_token_ids``: only those ids are sampled, greedy, random and beam search
alike, after ``logit_bias`` and with the ids banned before ``min_tokens``; on a real tiny
Llama the engine equals ``transformers`` given the same restriction
(``prefix_allowed_tokens_fn``). Beam search applies ``logit_bias`` as ``transformers`` applies
its ``sequence_bias``: to the log-probabilities."""

from __future__ import annotations

import pytest
import torch

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.model_limits import check_model_limits
from kvstore.requests.sampling_params import MAX_ALLOWED_TOKEN_IDS
from tests.engine.helpers import assert_no_blocks_in_use
from tests.engine.test_engine_transformers import EOS, PROMPTS, engine_for, hf_beams, hf_greedy
from worker.engine import FinishReason, SamplingParams
from worker.engine.sampler import SampleSpec, sample

ALLOWED = (7, 19, 42, 101, 250, 333)


def test_each_row_samples_only_its_allowed_ids() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    specs = [
        SampleSpec(SamplingParams(temperature=0, allowed_token_ids=(3, 7, 11)), None),
        SampleSpec(SamplingParams(temperature=5.0, allowed_token_ids=(1, 2)), g),
        SampleSpec(SamplingParams(temperature=0), None),  # its neighbours' masks are theirs
    ]
    seen: set[int] = set()
    for _ in range(200):
        toks, _ = sample(logits, specs, g)
        assert toks[0] == max((3, 7, 11), key=lambda t: float(logits[0, t]))
        assert toks[2] == int(logits[2].argmax())
        seen.add(toks[1])  # type: ignore[arg-type]
    assert seen == {1, 2}  # a high temperature: both show up, nothing else does


def test_allowed_ids_apply_after_logit_bias_and_with_banned_ids() -> None:
    logits = torch.zeros(1, 16)
    logits[0, 9] = 50.0  # the model's favourite, not allowed
    params = SamplingParams(temperature=0, allowed_token_ids=(3, 4, 5), logit_bias=((5, 20.0),))
    assert sample(logits, [SampleSpec(params, None)], torch.Generator())[0] == [5]
    # 5 banned (an EOS before min_tokens): the best of what is left
    logits[0, 4] = 1.0
    assert sample(logits, [SampleSpec(params, None, (5,))], torch.Generator())[0] == [4]


def test_ids_are_checked_against_the_field_rules_and_the_vocabulary() -> None:
    for bad in ((-1,), ("3",), (True,)):
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(allowed_token_ids=bad)  # type: ignore[arg-type]
        assert err.value.field == "allowed_token_ids"
    with pytest.raises(InvalidRequest, match=f"at most {MAX_ALLOWED_TOKEN_IDS}"):
        SamplingParams(allowed_token_ids=tuple(range(MAX_ALLOWED_TOKEN_IDS + 1)))
    with pytest.raises(InvalidRequest, match="vocab_size=64") as err:
        check_model_limits(
            [1], SamplingParams(allowed_token_ids=(3, 64)), vocab_size=64, max_model_len=8
        )
    assert (err.value.field, err.value.value) == ("allowed_token_ids", 64)


def test_greedy_and_sampled_requests_equal_transformers_restriction(tiny_dir, hf_model) -> None:
    engine = engine_for(tiny_dir)
    prompts = PROMPTS[:4]
    greedy = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=ALLOWED)
    sampled = SamplingParams(temperature=1.5, n=3, max_tokens=12, allowed_token_ids=ALLOWED)
    plain = SamplingParams(temperature=0, max_tokens=12)
    results = engine.generate(prompts + prompts[:1], [greedy] * 3 + [sampled, plain])
    for prompt, res in zip(prompts[:3], results, strict=False):
        assert res.completions[0].token_ids == hf_greedy(
            hf_model, prompt, 12, prefix_allowed_tokens_fn=lambda *_: list(ALLOWED)
        )
    assert all(t in ALLOWED for c in results[3].completions for t in c.token_ids)
    assert len({tuple(c.token_ids) for c in results[3].completions}) > 1  # sampled, not greedy
    assert any(t not in ALLOWED for t in results[4].completions[0].token_ids)  # a batch-mate
    assert_no_blocks_in_use(engine)


def test_beam_search_with_allowed_ids_equals_transformers(tiny_dir, hf_model) -> None:
    prompt, allowed = PROMPTS[2], (*ALLOWED, *EOS)  # beams may end
    expected = hf_beams(
        hf_model, prompt, 8, 1.0, False, EOS, prefix_allowed_tokens_fn=lambda *_: list(allowed)
    )
    engine = engine_for(tiny_dir)
    params = SamplingParams(beam_width=4, n=4, max_tokens=8, allowed_token_ids=allowed)
    result = engine.generate([prompt], params)[0]
    assert [c.token_ids for c in result.completions] == [t for t, _ in expected]
    for c, (_, ref) in zip(result.completions, expected, strict=True):
        assert c.cumulative_logprob == pytest.approx(ref, abs=1e-4)
    assert_no_blocks_in_use(engine)


def test_beam_search_applies_logit_bias_as_transformers_sequence_bias(tiny_dir, hf_model) -> None:
    prompt = PROMPTS[1]
    bias = ((42, 6.0), (101, -3.0))
    expected = hf_beams(
        hf_model, prompt, 8, 1.0, False, EOS, sequence_bias={(t,): b for t, b in bias}
    )
    unbiased = hf_beams(hf_model, prompt, 8, 1.0, False, EOS)
    assert [t for t, _ in expected] != [t for t, _ in unbiased]  # the bias changes the beams
    engine = engine_for(tiny_dir)
    result = engine.generate(
        [prompt], SamplingParams(beam_width=4, n=4, max_tokens=8, logit_bias=bias)
    )[0]
    assert [c.token_ids for c in result.completions] == [t for t, _ in expected]
    for c in result.completions:
        stopped = c.token_ids[-1] in EOS
        assert c.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)
    assert_no_blocks_in_use(engine)


def test_allowed_ids_that_min_tokens_would_all_mask_are_refused(tiny_dir) -> None:
    engine = engine_for(tiny_dir)
    params = SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=EOS, stop_token_ids=())
    with pytest.raises(InvalidRequest, match="masked until min_tokens=2") as err:
        engine.generate([PROMPTS[0]], params)
    assert err.value.field == "allowed_token_ids"
    ok = SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(*EOS, 42))
    assert engine.generate([PROMPTS[0]], ok)[0].completions[0].token_ids[:2] == [42, 42]
    assert_no_blocks_in_use(engine)
