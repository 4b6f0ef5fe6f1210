"""ReasoningSplit: a reasoning model's output as (reasoning, content), whole and streamed in
any chunking alike, from each place the prompt can leave the output; and where a prompt
leaves it (ReasoningMarkers.prompt_state)."""

from __future__ import annotations

import random

import pytest

from router.serving.reasoning_split import ReasoningSplit
from worker.model.reasoning_markers import ReasoningMarkers

M = ReasoningMarkers(90, 91)

CASES = [
    # (prompt state, output, reasoning, content)
    ("none", "<think>\nLet me think.\n</think>\n\nParis.", "Let me think.", "Paris."),
    ("none", "  <think>a b  c</think>d  e ", "a b  c", "d  e "),
    ("none", "Paris, <think>not reasoning</think>", "", "Paris, <think>not reasoning</think>"),
    ("none", "\n<thin", "", "\n<thin"),  # ended on what might have opened it
    ("none", "<think>cut by max_tokens ", "cut by max_tokens", ""),
    ("none", "<think></think>", "", ""),
    ("none", "", "", ""),
    ("open", "\nHmm, 2 + 2.\n</think>\n\n4", "Hmm, 2 + 2.", "4"),
    ("open", "all reasoning, never closed\n", "all reasoning, never closed", ""),
    ("open", "x </thi y</think>z", "x </thi y", "z"),  # a marker's beginning, not a marker
    ("open", "a</think>b</think>c", "a", "b</think>c"),  # only the first end counts
    ("closed", "<think>x</think>y", "", "<think>x</think>y"),
    ("closed", "\n\nplain", "", "\n\nplain"),
]


@pytest.mark.parametrize(("state", "text", "reasoning", "content"), CASES)
def test_a_whole_answer_splits_where_its_markers_are(
    state: str, text: str, reasoning: str, content: str
) -> None:
    assert ReasoningSplit(M, state).split(text) == (reasoning, content)  # type: ignore[arg-type]


@pytest.mark.parametrize(("state", "text", "reasoning", "content"), CASES)
def test_streamed_in_any_chunking_it_reads_as_the_whole(
    state: str, text: str, reasoning: str, content: str
) -> None:
    rng = random.Random(len(text))
    chunkings = [list(text), [text]]  # a character at a time, and one piece
    for _ in range(30 if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in chunkings:
        split = ReasoningSplit(M, state)  # type: ignore[arg-type]
        got = [split.feed(p) for p in pieces] + [split.finish()]
        assert "".join(r for r, _ in got) == reasoning, pieces
        assert "".join(c for _, c in got) == content, pieces


def test_streamed_pieces_go_out_as_soon_as_they_cannot_be_a_marker() -> None:
    split = ReasoningSplit(M, "none")
    assert split.feed("<th") == ("", "")  # may still open the reasoning
    assert split.feed("ink>") == ("", "")
    assert split.feed("One ") == ("One", "")  # (its trailing space waits for what follows)
    assert split.feed("two</") == (" two", "")  # "</" may begin the end marker
    assert split.feed("b>") == ("</b>", "")
    assert split.feed("</think>\n") == ("", "")
    assert split.feed("\nAnswer") == ("", "Answer")
    assert split.feed(" and more") == ("", " and more")
    assert split.finish() == ("", "")


def test_an_output_that_does_not_open_the_reasoning_flows_as_it_comes() -> None:
    split = ReasoningSplit(M, "none")
    assert split.feed("  ") == ("", "")  # only space so far: it may still open
    assert split.feed("Hi") == ("", "  Hi")
    assert split.feed(" <think>") == ("", " <think>")  # mid-answer: just text


def test_reasoning_tokens_count_the_output_up_to_and_with_the_end_marker() -> None:
    split = ReasoningSplit(M, "none")
    split.feed("<think>ab", [90, 5, 6])
    assert split.reasoning_tokens == 3
    split.feed("c</think>d", [7, 91, 8])
    split.feed("e", [9])
    assert split.reasoning_tokens == 5
    opened = ReasoningSplit(M, "open")
    opened.split("x y", [5, 6, 7])  # never closed: all of it
    assert opened.reasoning_tokens == 3
    plain = ReasoningSplit(M, "none")
    plain.split("ab</think>", [5, 91])  # did not open it: none
    assert plain.reasoning_tokens == 0
    closed = ReasoningSplit(M, "closed")
    closed.split("<think>x</think>", [90, 5, 91])
    assert closed.reasoning_tokens == 0


def test_a_prompt_leaves_its_output_where_its_last_marker_does() -> None:
    assert M.prompt_state([1, 2, 3]) == "none"
    assert M.prompt_state([]) == "none"
    assert M.prompt_state([1, 90, 4]) == "open"  # DeepSeek-R1's template opens it
    assert M.prompt_state([1, 90, 4, 91, 5]) == "closed"  # Qwen3's enable_thinking: false
    assert M.prompt_state([90, 5, 91, 6, 90, 7]) == "open"  # an earlier turn's, then a new one


def test_markers_are_found_only_as_single_tokens_that_decoding_keeps() -> None:
    class Tok:
        def __init__(self, ids: dict[str, int], special: frozenset[int]) -> None:
            self.ids, self.special = ids, special

        def token_to_id(self, token: str) -> int | None:
            return self.ids.get(token)

        def special_ids(self) -> frozenset[int]:
            return self.special

    both = {"<think>": 5, "</think>": 6}
    assert ReasoningMarkers.of(Tok(both, frozenset())) == ReasoningMarkers(5, 6)
    assert ReasoningMarkers.of(Tok({"<think>": 5}, frozenset())) is None
    assert ReasoningMarkers.of(Tok(both, frozenset({6}))) is None  # dropped from the text
