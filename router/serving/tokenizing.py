"""Tokenization off the router's event loop, with big inputs kept apart from small ones.

A router serves every client from one event loop, and its default executor also runs the
index lookups. Tokenizing a megabyte takes a thread for a long time: done inline it stalls
every stream, done in the default executor a few such calls take all its threads and every
request waits behind them. So texts are tokenized in two pools of their own: short texts
(any ordinary prompt) in one, long texts in another of few threads, where a flood of huge
inputs queues only behind itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvstore.requests.errors import InvalidRequest
from router.placement.config import RequestLimits
from worker.model.tokenizer import Tokenizer

T = TypeVar("T")
SMALL_TEXT_CHARS = 16384  # up to here a text is "short": ~1 ms to tokenize


def prompt_chars_limit(limits: RequestLimits, max_model_len: int) -> int:
    """Longest text accepted for tokenizing: a prompt longer than this could not fit the
    model anyway, so it is rejected before any work is spent on it."""
    return min(limits.max_prompt_chars, max_model_len * limits.max_chars_per_token)


def check_text_chars(field: str, text: str, limits: RequestLimits, max_model_len: int) -> None:
    """Raises :class:`InvalidRequest` (naming ``field``, the length and the limit) for a text
    too long to tokenize; checked before tokenizing."""
    _check_chars(field, len(text), "a prompt", "", limits, max_model_len)


def check_chat_chars(
    messages: Sequence[Mapping[str, str]],
    limits: RequestLimits,
    max_model_len: int,
    rendered_chars: int = 0,
) -> int:
    """:func:`check_text_chars` for a conversation (its contents' total plus the tools and
    tool calls the template writes, ``ChatOptions.rendered_chars``, before the template is
    rendered: it only adds to them); returns that total."""
    text = sum(len(m.get("content", "")) + len(m.get("reasoning_content", "")) for m in messages)
    chars = text + rendered_chars
    of = " of content and tools" if rendered_chars else " of content"
    _check_chars("messages", chars, "a conversation", of, limits, max_model_len)
    return chars


def _check_chars(
    field: str, chars: int, what: str, of: str, limits: RequestLimits, max_model_len: int
) -> None:
    cap = prompt_chars_limit(limits, max_model_len)
    if chars > cap:
        raise InvalidRequest(
            field,
            f"<{chars} chars>",
            f"{what} must be at most {cap} characters{of} (the lower of max_model_len="
            f"{max_model_len} x router.limits.max_chars_per_token="
            f"{limits.max_chars_per_token} and router.limits.max_prompt_chars="
            f"{limits.max_prompt_chars})",
        )


class TokenizerPool:
    """``encode`` in a thread, short and long texts in separate pools."""

    def __init__(self, tokenizer: Tokenizer, *, long_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self._short = ThreadPoolExecutor(2, thread_name_prefix="tokenize-short")
        self._long = ThreadPoolExecutor(long_threads, thread_name_prefix="tokenize-long")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(len(text), self.tokenizer.encode, text, add_special_tokens)

    async def run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, tokenizing ``chars`` characters, in the pool for its size."""
        pool = self._short if chars <= SMALL_TEXT_CHARS else self._long
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def close(self) -> None:
        self._short.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)
