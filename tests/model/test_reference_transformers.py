"""The runner against transformers on random tiny models of every supported family.

Families cover: llama (Llama-3 rope scaling), mistral (sliding window 24, exceeded here),
qwen2 (QKV bias, tied embeddings), qwen3 (q/k RMSNorm, head_dim != hidden / heads), gemma3
((1 + weight) sandwich norms, GeGLU, query_pre_attn_scalar, scaled tied embeddings, windows of
12 beside a global layer, two rope bases).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.helpers import BlockHandout, greedy_generate, hf_logits, interleaved_steps
from worker.model.build_tiny import FAMILIES
from worker.model.config import ModelConfig
from worker.model.runner import ModelRunner, SeqChunk
from worker.model.tokenizer import Tokenizer

PROMPT_LENS = (1, 7, 16, 41)  # single token, partial block, exact block, > sliding window


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in PROMPT_LENS]


def test_families_exercise_their_traits(model_dirs):
    cfgs = {f: ModelConfig.from_dir(model_dirs[f]) for f in FAMILIES}
    assert cfgs["llama"].rope.rope_type == "llama3"
    assert cfgs["mistral"].sliding_windows == (24, 24)
    assert cfgs["qwen2"].qkv_bias and cfgs["qwen2"].tie_word_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim * cfgs["qwen3"].num_heads == 128
    assert cfgs["gemma3"].sliding_windows == (12,) * 5 + (None, 12)
    assert cfgs["gemma3"].local_rope is not None and cfgs["gemma3"].hidden_act != "silu"
    assert all(c.num_kv_heads < c.num_heads for c in cfgs.values())  # GQA everywhere


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_logits_match(family, model_dirs, hf_model):
    path = model_dirs[family]
    runner = ModelRunner(path, block_size=4, num_blocks=64)
    prompts = _prompts(runner.config.vocab_size)
    blocks = BlockHandout(runner.num_blocks)
    chunks = [SeqChunk(p, 0, blocks.table(len(p), 4), "all") for p in prompts]
    logits = runner.execute(runner.build_input(chunks))
    expected = torch.cat([hf_logits(hf_model(path), p) for p in prompts])
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decode_matches_full_forward(family, model_dirs, hf_model):
    """Two sequences in one batch per step: A prefills in chunks of 5 while B decodes one
    token per step through the paged cache; every logit row matches the full forward."""
    path = model_dirs[family]
    runner = ModelRunner(path, block_size=4, num_blocks=64)
    rng = random.Random(1)
    seq_a = [rng.randrange(5, 500) for _ in range(30)]
    seq_b = [rng.randrange(5, 500) for _ in range(30)]
    got = interleaved_steps(runner, [seq_a, seq_b])
    for s, seq in enumerate((seq_a, seq_b)):
        torch.testing.assert_close(got[s], hf_logits(hf_model(path), seq), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers_generate(family, model_dirs, hf_model):
    path = model_dirs[family]
    runner = ModelRunner(path, block_size=4, num_blocks=128)
    tok = Tokenizer.from_dir(path)
    texts = ["Paged attention stores the cache", "Hello", "Question: what is two plus two?"]
    prompts = [tok.encode(t) for t in texts]
    ours = greedy_generate(runner, prompts, 32, stop_ids=tok.eos_token_ids)
    model = hf_model(path)
    for prompt, mine in zip(prompts, ours, strict=True):
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=32,
            pad_token_id=tok.pad_token_id,
        )
        assert mine == out[0, len(prompt) :].tolist()
    assert max(len(o) for o in ours) == 32  # at least one ran the full 32 tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_on_cpu(family, model_dirs, hf_model):
    path = model_dirs[family]
    runner = ModelRunner(path, dtype="bfloat16", block_size=4, num_blocks=64)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = _prompts(runner.config.vocab_size, seed=5)
    blocks = BlockHandout(runner.num_blocks)
    chunks = [SeqChunk(p, 0, blocks.table(len(p), 4), "all") for p in prompts]
    logits = runner.execute(runner.build_input(chunks))
    assert logits.dtype == torch.float32
    expected = torch.cat([hf_logits(hf_model(path), p) for p in prompts])
    # bf16 keeps ~3 significant digits; logits here are O(1).
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tokenizer_matches_transformers(family, model_dirs):
    transformers = pytest.importorskip("transformers")
    path = model_dirs[family]
    ours = Tokenizer.from_dir(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for text in ["The cache of keys and values.", "12345 don't  stop\n\n ünïcode 🙂", ""]:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ours.encode_chat(messages)[0] == (ours.bos_token_id if family == "llama" else 3)
    assert ours.vocab_size == ModelConfig.from_dir(path).vocab_size
    assert set(ours.eos_token_ids) == {ours.token_to_id("</s>"), ours.token_to_id("<|im_end|>")}
