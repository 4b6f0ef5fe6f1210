"""Server-sent events: the encoding of a stream chunk, and the per-token fast path.

Most of a stream's events are the same object with another text: no logprobs, no tools, no
usage that changes, not the first event of its choice. :class:`PlainChunks` writes those
from text pieces encoded once per request, with only the new text (and the choice's index
and finish reason) put in; the bytes are exactly what :func:`sse_event` makes of the chunk
object :meth:`Shaper.chunk` builds (a test compares the two). Every other event goes
through the object.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any

# json.dumps with its own separators builds an encoder per call; one shared is the same
_compact = json.JSONEncoder(separators=(",", ":")).encode
DONE = b"data: [DONE]\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    """One event carrying ``obj`` as compact JSON."""
    return b"data: " + _compact(obj).encode() + b"\n\n"


def typed_event(kind: str, obj: dict[str, Any]) -> bytes:
    """One event named ``kind`` (an ``event:`` line, as the Responses API's stream has)
    carrying ``obj`` as compact JSON."""
    return b"event: " + kind.encode() + b"\ndata: " + _compact(obj).encode() + b"\n\n"


class PlainChunks:
    """The events of one request's plain chunks, from pre-encoded parts.

    ``head``: the chunk's leading fields (id, object, created, model), in order; ``chat``:
    the text goes in ``delta.content`` (else in ``text``); ``usage_null``: the chunk ends
    with ``"usage":null`` (include_usage without continuous usage)."""

    __slots__ = ("_pre", "_key", "_post", "_end")

    def __init__(self, head: dict[str, Any], *, chat: bool, usage_null: bool) -> None:
        self._pre = "data: " + _compact(head)[:-1] + ',"choices":[{"index":'
        self._key = ',"delta":{"content":' if chat else ',"text":'
        self._post = ("}" if chat else "") + ',"logprobs":null,"finish_reason":'
        self._end = ("}]" + (',"usage":null}' if usage_null else "}") + "\n\n").encode()

    def event(self, index: int, text: str, finish_reason: str | None) -> bytes:
        reason = "null" if finish_reason is None else encode_basestring_ascii(finish_reason)
        body = f"{self._pre}{index}{self._key}{encode_basestring_ascii(text)}{self._post}{reason}"
        return body.encode() + self._end
