"""The engine on a real tiny Llama against ``transformers`` as the reference."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, FinishReason, SamplingParams

EOS = (2, 4)  # the tiny model's generation_config eos ids
MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(5, 512) for _ in range(n)] for n in (3, 17, 33, 50, 64, 90)]
_cache: dict[tuple, list[int]] = {}


def hf_greedy(
    hf_model, prompt: list[int], max_new: int = MAX_NEW, min_new: int = 0, **processors
) -> list[int]:
    """``processors``: generate's own (``prefix_allowed_tokens_fn``); not cached."""
    key = (tuple(prompt), max_new, min_new)
    if key not in _cache or processors:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new,
                min_new_tokens=min_new,
                do_sample=False,
                eos_token_id=list(EOS),
                pad_token_id=0,
                **processors,
            )
        gen = out[0, len(prompt) :].tolist()
        stop = next((i for i, t in enumerate(gen) if t in EOS), None)
        gen = gen if stop is None else gen[: stop + 1]
        if processors:
            return gen
        _cache[key] = gen
    return _cache[key]


def engine_for(tiny_dir, **cfg) -> Engine:
    cfg.setdefault("num_blocks", 256)
    return Engine.from_model_dir(tiny_dir, EngineConfig(**cfg))


def test_greedy_batch_equals_transformers(tiny_dir, hf_model, tokenizer) -> None:
    engine = engine_for(tiny_dir)
    results = engine.generate(PROMPTS, GREEDY)
    for prompt, res in zip(PROMPTS, results, strict=True):
        comp = res.completions[0]
        assert comp.token_ids == hf_greedy(hf_model, prompt)
        assert comp.text == tokenizer.decode(comp.token_ids)
        assert res.usage.prompt_tokens == len(prompt)
        assert res.usage.completion_tokens == len(comp.token_ids)
    assert engine.metrics().num_preemptions == 0
    assert_no_blocks_in_use(engine)


def test_tiny_kv_pool_preempts_and_chunks_with_identical_outputs(tiny_dir, hf_model) -> None:
    engine = engine_for(
        tiny_dir,
        num_blocks=10,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
    )
    # min_tokens = max_tokens keeps EOS out, so every request grows to its full length
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    results = engine.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, results, strict=True):
        expected = hf_greedy(hf_model, prompt, min_new=MAX_NEW)
        assert res.completions[0].token_ids == expected, res.request_id
    m = engine.metrics()
    assert m.num_preemptions > 0, m
    assert m.num_partial_prefills > 0, m
    assert_no_blocks_in_use(engine)


def test_prefix_hit_reports_cached_tokens_and_keeps_the_output(tiny_dir, hf_model) -> None:
    shared = PROMPTS[4]  # 64 tokens = 4 full blocks of 16
    a, b = shared + [7, 8, 9], shared + [10, 11]
    engine = engine_for(tiny_dir)
    first = engine.generate([a], GREEDY)[0]
    before = engine.metrics().computed_tokens
    second = engine.generate([b], GREEDY)[0]
    computed = engine.metrics().computed_tokens - before
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 64
    n_out = len(second.completions[0].token_ids)
    assert computed == len(b) - 64 + n_out - 1  # the suffix, then one token per decode
    assert second.completions[0].token_ids == hf_greedy(hf_model, b)
    no_cache = engine_for(tiny_dir, enable_prefix_caching=False).generate([b], GREEDY)[0]
    assert no_cache.usage.cached_tokens == 0
    assert no_cache.completions[0].token_ids == second.completions[0].token_ids
    assert engine.metrics().prefix_hit_rate > 0


def test_parallel_samples_share_prompt_blocks_and_seeds_reproduce(tiny_dir) -> None:
    prompt = PROMPTS[3]  # 50 tokens: 3 full blocks + 1 partial
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine = engine_for(tiny_dir)
    rid = engine.add_request(prompt, params)
    engine.step()  # one prefill; the 4 samples are forks of it
    assert engine.kv.stats().used_blocks == 4  # not 16
    assert len(engine.requests[rid].seqs) == 4
    engine.step()  # each sample copies the shared partial block on its first write
    assert engine.kv.stats().used_blocks == 3 + 4
    while engine.has_unfinished_requests():
        engine.step()
    alone = engine.generate([prompt], params)[0]
    samples = [tuple(c.token_ids) for c in alone.completions]
    assert len(set(samples)) == 4  # temperature 1.0: the samples differ
    # Same seed inside a different batch (other requests, other sizes): same samples.
    crowd = engine.generate(
        [PROMPTS[1], prompt, PROMPTS[5]],
        [
            SamplingParams(temperature=1.0, max_tokens=20),
            params,
            GREEDY,
        ],
    )
    assert [tuple(c.token_ids) for c in crowd[1].completions] == samples
    other = engine.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=8, max_tokens=12))
    assert [tuple(c.token_ids) for c in other[0].completions] != samples
    assert_no_blocks_in_use(engine)


def hf_beams(hf_model, prompt, max_new, lp, es, eos, min_new=0, **processors):
    """``processors``: generate's own (``sequence_bias``, ``prefix_allowed_tokens_fn``)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=4,
            num_return_sequences=4,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=lp,
            early_stopping=es,
            eos_token_id=list(eos),
            pad_token_id=0,
            min_new_tokens=min_new,
            return_dict_in_generate=True,
            output_scores=True,
            **processors,
        )
    beams = []
    for i in range(4):
        n = int((out.beam_indices[i] >= 0).sum())
        beams.append(
            (
                out.sequences[i, len(prompt) : len(prompt) + n].tolist(),
                float(out.sequences_scores[i]),
            )
        )
    return beams


@pytest.mark.parametrize(
    ("prompt_idx", "lp", "es", "extra_stop", "min_new"),
    [
        (1, 1.0, False, True, 0),
        (2, 0.5, True, True, 0),
        (3, 2.0, "never", True, 0),
        (0, 1.0, False, False, 0),
        (2, -0.5, False, True, 3),
    ],
)
def test_beam_search_equals_transformers(
    tiny_dir, hf_model, prompt_idx, lp, es, extra_stop, min_new
) -> None:
    prompt, max_new = PROMPTS[prompt_idx], 10
    stops: tuple[int, ...] = ()
    if extra_stop:  # a token the model likes, so that beams finish early and often
        greedy = hf_greedy(hf_model, prompt)
        stops = (max(set(greedy), key=greedy.count),)
    expected = hf_beams(hf_model, prompt, max_new, lp, es, EOS + stops, min_new)
    engine = engine_for(tiny_dir)
    params = SamplingParams(
        beam_width=4,
        n=4,
        max_tokens=max_new,
        length_penalty=lp,
        early_stopping=es,
        stop_token_ids=stops,
        min_tokens=min_new,
    )
    result = engine.generate([prompt], params)[0]
    got = [(c.token_ids, c.cumulative_logprob) for c in result.completions]
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, score), (_, ref) in zip(got, expected, strict=True):
        assert score == pytest.approx(ref, abs=1e-4)
    for c in result.completions:
        stopped = c.token_ids[-1] in EOS + stops
        assert c.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)
    assert_no_blocks_in_use(engine)


def test_beam_search_frees_pruned_beams_and_shares_blocks(tiny_dir) -> None:
    engine = engine_for(tiny_dir)
    prompt = PROMPTS[5]  # 90 tokens: 5 full blocks + 1 partial
    engine.add_request(prompt, SamplingParams(beam_width=4, max_tokens=30, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        peak = max(peak, engine.kv.stats().used_blocks)
    # 4 beams of up to 120 tokens each would need 4 * 8 = 32 blocks without sharing.
    assert peak <= 5 + 4 * 3, peak
    assert_no_blocks_in_use(engine)


def test_beam_search_survives_preemption(tiny_dir, hf_model) -> None:
    # A pool so small that a more important request preempts the growing beams again and
    # again; recomputed beams (each its own prefill, sharing via the prefix cache) must
    # continue exactly where they were.
    prompt = PROMPTS[3]
    expected = hf_beams(hf_model, prompt, 12, 1.0, False, EOS)
    engine = engine_for(
        tiny_dir, num_blocks=10, max_num_batched_tokens=64, max_num_seqs=8, policy="priority"
    )
    params = SamplingParams(beam_width=4, n=4, max_tokens=12, priority=1)
    filler = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    results = engine.generate([prompt, PROMPTS[4]], [params, filler])
    assert [c.token_ids for c in results[0].completions] == [t for t, _ in expected]
    assert results[1].completions[0].token_ids == hf_greedy(hf_model, PROMPTS[4], min_new=MAX_NEW)
    assert engine.metrics().num_preemptions >= 3
    assert_no_blocks_in_use(engine)
