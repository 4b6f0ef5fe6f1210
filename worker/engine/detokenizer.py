"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level and SentencePiece tokenizers: one character
may span several tokens (a partial one decodes to U+FFFD) and a token's leading space depends
on what precedes it. :class:`IncrementalDetokenizer` therefore decodes a small sliding window
twice — the already-emitted part and the part plus the new tokens — and emits the difference
once it no longer ends in a partial character (the approach of TGI and vLLM).

:class:`OutputText` adds stop strings on top: it searches only the new text (plus the longest
stop string's length of old text, so a stop string spanning tokens is found), truncates at a
match, and holds back the last ``len(longest stop) - 1`` characters while streaming so no
prefix of a stop string is ever sent and then taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output token (leading spaces)


class TokenizerLike(Protocol):
    """What the engine needs from a tokenizer (``worker.model.tokenizer.Tokenizer`` fits)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    # optional: ``special_ids() -> frozenset[int]``, ids ``decode`` drops when it skips
    # special tokens (worker.model.tokenizer.Tokenizer has it)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    __slots__ = ("_tok", "_skip", "_ids", "_prefix", "_read", "_prefix_text", "_silent")

    def __init__(
        self, tokenizer: TokenizerLike, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])  # decoding window
        self._prefix = 0  # window start: context for the leading space of the next text
        self._read = len(self._ids)  # ids before this offset are already emitted
        # text of ids[_prefix:_read]; kept while a character is pending (those ids do not
        # change until the next emission), so a pending token costs one decode, not two
        self._prefix_text: str | None = None
        # ids that decode to nothing wherever they stand (special tokens, when skipped): one
        # adds no text, so it is appended without decoding (the text it would give is "")
        special = getattr(tokenizer, "special_ids", None)
        self._silent: frozenset[int] = (
            special() if skip_special_tokens and special is not None else frozenset()
        )

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text ("" if a character is pending)."""
        self._ids.append(token_id)
        if token_id in self._silent:
            # decode() drops it: the window decodes as before this call, to text that was
            # pending or emitted then (a fresh window holds only emitted context): nothing new
            return ""
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        # The emitted part becomes the next window's context; older ids no longer matter, so
        # every call decodes a window of bounded size.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text = None
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text of pending ids (e.g. an incomplete character at the end of generation)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""  # the window is empty now
        return new_text[len(prefix_text) :]


class OutputText:
    """A sample's text: incremental detokenization, stop strings, streaming hold-back."""

    __slots__ = ("_detok", "_stops", "_include", "_holdback", "text", "_emitted")

    def __init__(
        self,
        detok: IncrementalDetokenizer,
        stops: Sequence[str] = (),
        include_stop_str: bool = False,
    ) -> None:
        self._detok = detok
        self._stops = tuple(stops)
        self._include = include_stop_str
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # text so far (truncated at a matched stop string)
        self._emitted = 0  # characters of ``text`` already handed out

    def add(self, token_id: int, *, check_stops: bool, show: bool = True) -> str | None:
        """Append a token's text; return the stop string it completed, if any.

        ``show=False`` appends the token without text (EOS / stop token ids are not shown).
        ``check_stops=False`` before ``min_tokens`` are reached.
        """
        if not show:
            return None
        delta = self._detok.add(token_id)
        if not delta:
            return None
        start = max(0, len(self.text) - self._holdback)
        self.text += delta
        if not check_stops or not self._stops:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self._include else at]
        return stop

    def finish(self, flush: bool) -> None:
        """End of generation: ``flush`` appends a trailing incomplete character if any."""
        if flush:
            self.text += self._detok.flush()

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, minus the stop-string hold-back."""
        end = len(self.text) if finished or not self._stops else len(self.text) - self._holdback
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
