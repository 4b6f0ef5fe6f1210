"""The engine on the tiny Gemma 3 (sliding-window layers of 12 tokens beside a global one)
against transformers: the KV cache manager keeps every block of a sequence (the global
layer reads them all; blocks behind a window stay allocated, none is freed early), so
preemption, chunked prefill and prefix hits give transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.model.build_tiny import build_tiny_model

MAX_NEW = 16
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(5, 512) for _ in range(n)] for n in (3, 20, 45, 70)]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("engine-gemma3") / "gemma3", "gemma3")


@pytest.fixture(scope="module")
def expected(gemma_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32)
    out = {}
    for prompt in PROMPTS:
        with torch.no_grad():
            gen = model.eval().generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
            )
        out[tuple(prompt)] = gen[0, len(prompt) :].tolist()
    return out


PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def test_preemption_and_chunked_prefill_keep_transformers_tokens(gemma_dir, expected):
    engine = Engine.from_model_dir(
        gemma_dir,
        EngineConfig(
            num_blocks=10, max_num_seqs=4, max_num_batched_tokens=24, long_prefill_token_threshold=8
        ),
    )
    results = engine.generate(PROMPTS, PARAMS)
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.completions[0].token_ids == expected[tuple(prompt)]
    m = engine.metrics()
    assert m.num_preemptions > 0 and m.num_partial_prefills > 0, m
    assert_no_blocks_in_use(engine)


def test_prefix_hit_past_the_window_keeps_the_output(gemma_dir, expected):
    engine = Engine.from_model_dir(gemma_dir, EngineConfig(num_blocks=64))
    long = PROMPTS[3]
    engine.generate([long[:64] + [9, 9]], PARAMS)  # caches 4 blocks of 16, beyond the window
    result = engine.generate([long], PARAMS)[0]
    assert result.usage.cached_tokens == 64
    assert result.completions[0].token_ids == expected[tuple(long)]
    assert_no_blocks_in_use(engine)
