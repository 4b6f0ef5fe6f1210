"""Incremental detokenization and stop strings with the tiny model's byte-level tokenizer."""

from __future__ import annotations

import random

from worker.engine.detokenizer import IncrementalDetokenizer, OutputText

TEXTS = [
    "Hello world, ünïcödé 日本語 test",
    "  leading spaces and\nnew lines\t tabs 🙂 emoji",
    "plain ascii only here",
]


def stream(tokenizer, prompt: list[int], out: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(t) for t in out]
    return deltas, "".join(deltas) + detok.flush()


def test_deltas_add_up_to_the_full_decode_and_never_split_characters(tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for cut in range(len(ids)):
            prompt, out = ids[:cut], ids[cut:]
            if tokenizer.decode(prompt).endswith("\ufffd"):
                continue  # the prompt ends inside a character: its rest is not output text
            deltas, joined = stream(tokenizer, prompt, out)
            assert joined == tokenizer.decode(out), (text, cut)
            assert not any("\ufffd" in d for d in deltas), (text, cut, deltas)


def test_random_token_streams_match_full_decode(tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(50):
        prompt = tokenizer.encode(rng.choice(TEXTS)[: rng.randint(0, 12)], add_special_tokens=False)
        out = [rng.randrange(5, 512) for _ in range(rng.randint(1, 40))]
        _, joined = stream(tokenizer, prompt, out)
        assert joined == tokenizer.decode(out)


def _output_text(tokenizer, stops, include=False) -> OutputText:
    return OutputText(IncrementalDetokenizer(tokenizer, []), stops, include)


def test_stop_string_spanning_tokens_truncates_and_is_never_streamed(tokenizer) -> None:
    ids = tokenizer.encode("Hello world, and more", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[:4] == ["H", "ell", "o", " wor"]  # "o wo" spans three tokens
    for include in (False, True):
        text = _output_text(tokenizer, ["o wo"], include)
        streamed, matched = "", None
        for tok in ids:
            matched = text.add(tok, check_stops=True)
            streamed += text.take_delta(finished=matched is not None)
            assert "o w" not in streamed or include  # no prefix of the stop leaks early
            if matched:
                break
        assert matched == "o wo"
        assert streamed == ("Hello wo" if include else "Hell")


def test_stop_strings_are_ignored_while_check_is_off(tokenizer) -> None:
    text = _output_text(tokenizer, ["ell"])
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    assert [text.add(t, check_stops=False) for t in ids] == [None] * len(ids)
    assert text.take_delta(finished=True) == "Hello"


def test_hidden_tokens_add_no_text(tokenizer) -> None:
    text = _output_text(tokenizer, [])
    for tok in tokenizer.encode("Hi", add_special_tokens=False):
        text.add(tok, check_stops=True)
    text.add(tokenizer.encode("there", add_special_tokens=False)[0], check_stops=True, show=False)
    assert text.take_delta(finished=True) == "Hi"


class _DecodeOnly:
    """The same tokenizer without ``special_ids``: the detokenizer decodes every token."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self._t = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._t.encode(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return self._t.decode(ids, skip_special_tokens)


def test_special_tokens_skip_decoding_yet_every_delta_is_the_decoded_one(tokenizer) -> None:
    """Skipped special ids are appended without a decode (they decode to nothing): streams
    thick with them, between multi-byte characters and after flushes, give the very deltas
    of a detokenizer that decodes every token, with and without skipping them."""
    special = sorted(tokenizer.special_ids())
    assert len(special) > 4 and tokenizer.decode(special) == ""
    rng = random.Random(3)
    text_ids = [i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False)]
    for case in range(60):
        prompt = [rng.choice(text_ids + special) for _ in range(rng.randint(0, 8))]
        out = [
            rng.choice(special) if rng.random() < 0.6 else rng.choice(text_ids)
            for _ in range(rng.randint(1, 40))
        ]
        for skip in (True, False):
            fast = IncrementalDetokenizer(tokenizer, prompt, skip)
            slow = IncrementalDetokenizer(_DecodeOnly(tokenizer), prompt, skip)
            for i, tok in enumerate(out):
                assert fast.add(tok) == slow.add(tok), (case, skip, i)
                if rng.random() < 0.05:
                    assert fast.flush() == slow.flush(), (case, skip, i)
            assert fast.flush() == slow.flush(), (case, skip)
