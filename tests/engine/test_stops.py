"""Stop rules on the fake model with the tiny model's real tokenizer (exact expectations)."""

from __future__ import annotations

import pytest

from tests.engine.fakes import FakeExecutor, reference_generate
from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, FinishReason, SamplingParams

V = 512


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("Once upon a time")


@pytest.fixture(scope="module")
def free_run(prompt) -> list[int]:
    """What the fake model says greedily when nothing stops it."""
    return reference_generate(prompt, 40, vocab=V, ignore_eos=True)


def make(tokenizer, eos: int) -> Engine:
    ex = FakeExecutor(128, 4, vocab_size=V, eos_token_ids=(eos,), tokenizer=tokenizer)
    return Engine(ex, EngineConfig(block_size=4, max_model_len=256))


def gen(engine: Engine, prompt, **params):
    result = engine.generate([prompt], SamplingParams(temperature=0, **params))[0]
    assert_no_blocks_in_use(engine)
    return result.completions[0]


def first_new_token(free_run: list[int], start: int) -> int:
    """Index of the first token at or after ``start`` that did not occur before it."""
    return next(i for i in range(start, len(free_run)) if free_run[i] not in free_run[:i])


def unused_token(free_run: list[int]) -> int:
    return next(t for t in range(5, V) if t not in free_run)


def test_eos_stops_and_is_not_shown(tokenizer, prompt, free_run) -> None:
    k = first_new_token(free_run, 6)
    comp = gen(make(tokenizer, eos=free_run[k]), prompt, max_tokens=40)
    assert comp.token_ids == free_run[: k + 1]
    assert (comp.finish_reason, comp.stop_reason) == (FinishReason.STOP, None)
    assert comp.text == tokenizer.decode(free_run[:k])


def test_ignore_eos_runs_to_max_tokens(tokenizer, prompt, free_run) -> None:
    k = first_new_token(free_run, 6)
    comp = gen(make(tokenizer, eos=free_run[k]), prompt, max_tokens=40, ignore_eos=True)
    assert comp.token_ids == free_run
    assert comp.finish_reason is FinishReason.LENGTH


def test_max_tokens(tokenizer, prompt, free_run) -> None:
    comp = gen(make(tokenizer, eos=unused_token(free_run)), prompt, max_tokens=5)
    assert comp.token_ids == free_run[:5]
    assert comp.finish_reason is FinishReason.LENGTH
    assert comp.text == tokenizer.decode(free_run[:5])


def test_min_tokens_suppresses_eos(tokenizer, prompt, free_run) -> None:
    k = first_new_token(free_run, 3)
    eos = free_run[k]
    comp = gen(make(tokenizer, eos=eos), prompt, max_tokens=40, min_tokens=k + 3)
    expected = reference_generate(prompt, 40, vocab=V, stop_ids=(eos,), min_tokens=k + 3)
    assert comp.token_ids == expected
    assert len(comp.token_ids) >= k + 3
    assert eos not in comp.token_ids[: k + 3]


def test_stop_token_ids(tokenizer, prompt, free_run) -> None:
    k = first_new_token(free_run, 4)
    engine = make(tokenizer, eos=unused_token(free_run))
    comp = gen(engine, prompt, max_tokens=40, stop_token_ids=[free_run[k]])
    assert comp.token_ids == free_run[: k + 1]
    assert (comp.finish_reason, comp.stop_reason) == (FinishReason.STOP, free_run[k])
    assert comp.text == tokenizer.decode(free_run[:k])


def _boundary_stop(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A 4-char stop string spanning two tokens, and how many tokens complete it."""
    for j in range(2, len(tokens) - 2):
        left, right = tokenizer.decode(tokens[:j]), tokenizer.decode(tokens[: j + 1])
        stop = left[-2:] + right[len(left) : len(left) + 2]
        if len(stop) == 4 and stop.isprintable() and "\ufffd" not in stop:
            texts = (tokenizer.decode(tokens[:m]) for m in range(1, len(tokens) + 1))
            done = 1 + next(m for m, text in enumerate(texts) if stop in text)
            return stop, done
    raise AssertionError("no usable boundary")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, prompt, free_run, include) -> None:
    stop, done = _boundary_stop(tokenizer, free_run)
    full = tokenizer.decode(free_run)
    at = full.find(stop)
    engine = make(tokenizer, eos=unused_token(free_run))
    comp = gen(
        engine,
        prompt,
        max_tokens=40,
        stop=[stop, "never-there"],
        include_stop_str_in_output=include,
    )
    assert (comp.finish_reason, comp.stop_reason) == (FinishReason.STOP, stop)
    assert comp.token_ids == free_run[:done]
    assert comp.text == full[: at + len(stop) if include else at]


def test_stop_string_not_matched_before_min_tokens(tokenizer, prompt, free_run) -> None:
    stop, done = _boundary_stop(tokenizer, free_run)
    engine = make(tokenizer, eos=unused_token(free_run))
    comp = gen(engine, prompt, max_tokens=done + 2, min_tokens=done + 1, stop=[stop])
    assert tokenizer.decode(free_run[: done + 2]).count(stop) == 1
    assert comp.finish_reason is FinishReason.LENGTH
    assert comp.token_ids == free_run[: done + 2]
