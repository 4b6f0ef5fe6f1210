"""vLLM's ``bad_words``: the worker tokenizes each (bare, and after a space where that spells
it with other tokens) and bans a word's last token wherever its others end the output. On a
real tiny Llama, greedy and beam search equal ``transformers`` given the same token ids
(``bad_words_ids``); sampled outputs never hold a bad word."""

from __future__ import annotations

import pytest

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.sampling_params import MAX_BAD_WORDS
from tests.engine.fakes import FakeExecutor
from tests.engine.helpers import assert_no_blocks_in_use
from tests.engine.test_engine_transformers import EOS, PROMPTS, engine_for, hf_beams, hf_greedy
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.intake import bad_word_ids


def contains(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


def words_from(tokenizer, ids: list[int]) -> list[str]:  # noqa: ANN001
    """Two words the unrestricted answer spells: one of its tokens, and a run of three."""
    return [tokenizer.decode(ids[2:3]), tokenizer.decode(ids[4:7])]


def test_words_are_tokenized_bare_and_after_a_space(tokenizer) -> None:  # noqa: ANN001
    ids = bad_word_ids(["hello", " world", "hello"], tokenizer)
    bare = tuple(tokenizer.encode("hello", add_special_tokens=False))
    assert ids[0] == bare and len(set(ids)) == len(ids)  # each spelling once
    spaced = tuple(tokenizer.encode(" world", add_special_tokens=False))
    assert spaced in ids or len(spaced) != len(tokenizer.encode("world", add_special_tokens=False))


def test_greedy_and_beams_equal_transformers_bad_words_ids(tiny_dir, hf_model, tokenizer) -> None:  # noqa: ANN001
    engine = engine_for(tiny_dir)
    prompt = PROMPTS[2]
    free = hf_greedy(hf_model, prompt, 16)
    words = words_from(tokenizer, free)
    ids = [list(w) for w in bad_word_ids(words, tokenizer)]
    expected = hf_greedy(hf_model, prompt, 16, bad_words_ids=ids)
    assert expected != free  # the words change the answer
    params = SamplingParams(temperature=0, max_tokens=16, bad_words=tuple(words))
    got = engine.generate([prompt], params)[0].completions[0].token_ids
    assert got == expected
    assert not any(contains(got, tuple(w)) for w in ids)
    beams = hf_beams(hf_model, prompt, 8, 1.0, False, EOS, bad_words_ids=ids)
    params = SamplingParams(beam_width=4, n=4, max_tokens=8, bad_words=tuple(words))
    result = engine.generate([prompt], params)[0]
    assert [c.token_ids for c in result.completions] == [t for t, _ in beams]
    assert_no_blocks_in_use(engine)


def test_sampled_outputs_never_hold_a_bad_word(tiny_dir, hf_model, tokenizer) -> None:  # noqa: ANN001
    engine = engine_for(tiny_dir)
    prompt = PROMPTS[1]
    words = words_from(tokenizer, hf_greedy(hf_model, prompt, 16))
    ids = bad_word_ids(words, tokenizer)
    params = SamplingParams(temperature=0.3, n=8, max_tokens=24, bad_words=tuple(words), seed=1)
    for c in engine.generate([prompt], params)[0].completions:
        assert not any(contains(c.token_ids, w) for w in ids), (c.token_ids, ids)
    assert_no_blocks_in_use(engine)


def test_bad_words_are_checked() -> None:
    for bad in (("",), ("  ",), (3,)):
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(bad_words=bad)  # type: ignore[arg-type]
        assert err.value.field == "bad_words"
    with pytest.raises(InvalidRequest, match=f"at most {MAX_BAD_WORDS}"):
        SamplingParams(bad_words=("x",) * (MAX_BAD_WORDS + 1))


def test_an_engine_without_a_tokenizer_refuses_bad_words() -> None:
    engine = Engine(FakeExecutor(64, 4), EngineConfig(block_size=4, max_model_len=64))
    with pytest.raises(InvalidRequest, match="need a tokenizer") as err:
        engine.generate([[5, 6, 7]], SamplingParams(bad_words=("x",)))
    assert err.value.field == "bad_words"
