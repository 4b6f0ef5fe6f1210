"""A reasoning model's answer split into its reasoning and its content, whole or as it streams:
the text between ``<think>`` and ``</think>`` is the reasoning (``reasoning`` in a chat
message, a ``reasoning`` item in a Responses answer), the text after it the content, as vLLM
answers with a reasoning parser. Where the output begins (inside the reasoning, before any, or
past a closed one) is read from the prompt's tokens (``worker/model/reasoning_markers.py``).

Whitespace around the reasoning, and before the content that follows it, is dropped (the
models write ``<think>\\n...\\n</think>\\n\\n``): a streamed answer holds back only what may
still be a marker or trailing whitespace, so whole and streamed answers read the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.model.reasoning_markers import PromptReasoning, ReasoningMarkers


def _marker_tail(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that may begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplit:
    """One choice's output as (reasoning, content) pieces; ``reasoning_tokens`` counts the
    output's tokens up to and with the end marker (the reasoning's, as OpenAI's usage
    reports them)."""

    def __init__(self, markers: ReasoningMarkers, state: PromptReasoning) -> None:
        self.m = markers
        # "pending": the output may still open the reasoning; then "reasoning", "content"
        self.phase = {"open": "reasoning", "none": "pending", "closed": "content"}[state]
        self._counting = self.phase  # the same phases, followed over token ids
        self.reasoned = state == "open"  # the output had a reasoning span
        self.held = ""
        self._begun = False  # the reasoning's first non-space text went out
        self._trim_content = False  # content right after the reasoning: leading space dropped
        self.reasoning_tokens = 0

    def _count(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            if self._counting == "content":
                return
            if self._counting == "pending":
                if t != self.m.start_id:
                    self._counting = "content"
                    return
                self._counting = "reasoning"
            self.reasoning_tokens += 1
            if t == self.m.end_id:
                self._counting = "content"

    def feed(self, text: str, token_ids: Sequence[int] = (), last: bool = False) -> tuple[str, str]:
        """New output -> (reasoning, content) that may go out now; ``last``: the output
        ended with it (what is held goes out too, :meth:`finish`)."""
        thought, content = self._feed(text, token_ids)
        if last:
            more, rest = self.finish()
            thought, content = thought + more, content + rest
        return thought, content

    def _feed(self, text: str, token_ids: Sequence[int]) -> tuple[str, str]:
        if token_ids:
            self._count(token_ids)
        if self.phase == "content" and not self._trim_content:
            return "", text
        self.held += text
        reasoning = ""
        if self.phase == "pending":
            body = self.held.lstrip()
            if len(body) < len(self.m.start) and self.m.start.startswith(body):
                return "", ""  # (only space, or the start marker's beginning, so far)
            if not body.startswith(self.m.start):
                self.phase, held, self.held = "content", self.held, ""
                return "", held
            self.phase, self.reasoned, self.held = "reasoning", True, body[len(self.m.start) :]
        if self.phase == "reasoning":
            at = self.held.find(self.m.end)
            if at < 0:
                return self._reasoning_out(), ""
            reasoning = self._reasoning(self.held[:at].rstrip())
            self.phase, self._trim_content = "content", True
            self.held = self.held[at + len(self.m.end) :]
        content = self.held.lstrip()  # (phase content, right after the reasoning)
        self.held = ""
        if content:
            self._trim_content = False
        return reasoning, content

    def _reasoning(self, text: str) -> str:
        if not self._begun:
            text = text.lstrip()
            self._begun = bool(text)
        return text

    def _reasoning_out(self) -> str:
        """The reasoning that may go out: less a tail that may begin the end marker, and
        trailing space (which goes out with the text after it)."""
        keep = _marker_tail(self.held, self.m.end)
        ready = self.held[: len(self.held) - keep]
        out = ready.rstrip()
        self.held = ready[len(out) :] + self.held[len(ready) :]
        return self._reasoning(out)

    def finish(self) -> tuple[str, str]:
        """The output ended: what is still held, as (reasoning, content). A reasoning the
        output never closed (cut by max_tokens) is all reasoning."""
        held, self.held = self.held, ""
        if self.phase == "reasoning":
            return self._reasoning(held.rstrip()), ""
        if self.phase == "pending":
            return "", held
        return "", held.lstrip() if self._trim_content else held

    def split(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """A whole answer -> (reasoning, content)."""
        return self.feed(text, token_ids, last=True)
