"""The reasoning markers of a model's vocabulary: ``<think>`` ... ``</think>``, the span in
which reasoning models (Qwen3, DeepSeek-R1 and its distills, QwQ) think before they answer.

Both sides read the same two facts: a worker starts a request's grammar only after the
reasoning ends (``worker/engine/structured.py``), and the router's HTTP door answers the
reasoning apart from the content (``router/serving/reasoning_split.py``). Where the output
begins is read from the prompt's tokens, so every chat template is covered without naming it:
DeepSeek-R1's opens the span in the prompt, Qwen3's lets the model open it, and Qwen3's
``enable_thinking: false`` renders an empty span, closed, before the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

START, END = "<think>", "</think>"

# where a prompt leaves its output: inside the reasoning, past a closed one, or before any
PromptReasoning = Literal["open", "closed", "none"]


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    start_id: int
    end_id: int
    start: str = START
    end: str = END

    @classmethod
    def of(cls, tokenizer: Any) -> ReasoningMarkers | None:
        """The markers of ``tokenizer`` (its ``token_to_id`` and ``special_ids``) when both are
        single tokens that decoded text keeps; None otherwise (a special token is dropped by
        ``skip_special_tokens``, so the text could not show where the reasoning ends)."""
        start, end = tokenizer.token_to_id(START), tokenizer.token_to_id(END)
        if start is None or end is None or start == end:
            return None
        special = tokenizer.special_ids()
        if start in special or end in special:
            return None
        return cls(start, end)

    def prompt_state(self, prompt_ids: Sequence[int]) -> PromptReasoning:
        """Where ``prompt_ids`` leave the output: ``open`` when the prompt's last marker
        starts the reasoning, ``closed`` when it ends one, ``none`` without markers (the
        output may open the reasoning with its first token)."""
        if self.start_id not in prompt_ids and self.end_id not in prompt_ids:
            return "none"
        start, end = _last(prompt_ids, self.start_id), _last(prompt_ids, self.end_id)
        return "open" if start > end else "closed"


def _last(ids: Sequence[int], token: int) -> int:
    """The last position of ``token`` in ``ids`` (-1: none), scanned in C (the reversed
    copy costs less than a Python loop over a long prompt)."""
    backwards = list(ids)[::-1]
    try:
        return len(backwards) - 1 - backwards.index(token)
    except ValueError:
        return -1
