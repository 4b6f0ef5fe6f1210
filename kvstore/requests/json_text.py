"""JSON from clients, bounded before it is parsed: values and nesting.

``json.loads`` recurses in C and the code that walks its result recurses in Python, so a
deeply nested text ends in a RecursionError (a 500) and a huge one holds the GIL for long.
:func:`check_structure` counts a text's values and its nesting with bytes operations only
(no per-byte Python) before any parse. An HTTP body is scanned whole
(``router/http_api/body.py``); JSON that arrives inside a string field (a schema as text,
a tool call's arguments, gRPC's ``tools``) goes through :func:`loads`, with the same bounds.
"""

from __future__ import annotations

import json
from array import array
from itertools import accumulate
from typing import Any

from kvstore.requests.errors import InvalidRequest

_STRUCTURE = b',[]{}"'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_STEP = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))
SLICE_BYTES = 64 << 10
# JSON values, counted from the bytes as strings + commas + brackets (a container counts
# twice): an upper estimate of what json.loads would build
MAX_ITEMS = 1 << 17
MAX_DEPTH = 32  # nested lists / objects


class JSONTooLarge(ValueError):
    """A JSON text with more values or deeper nesting than allowed (found before parsing)."""


def check_structure(
    data: bytes, *, max_items: int = MAX_ITEMS, max_depth: int = MAX_DEPTH, what: str = "JSON"
) -> None:
    """Raise :class:`JSONTooLarge` for a text with more JSON values or deeper nesting than
    allowed, from its bytes alone (strings' contents do not count: a prompt full of commas
    is one value).

    Bytes operations run in C holding the GIL, so the text is scanned in slices of
    :data:`SLICE_BYTES`: in a thread, this lets the event loop run between slices."""
    values = depth = deepest = 0
    inside = False  # in a string at the slice's start
    carry = b""  # a run of backslashes at a slice's end: escapes pair them left to right
    for at in range(0, len(data), SLICE_BYTES):
        piece = carry + data[at : at + SLICE_BYTES]
        cut = len(piece.rstrip(b"\\"))
        piece, carry = piece[:cut], piece[cut:]
        # drop escaped backslashes, then escaped quotes: every '"' left opens or closes
        piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        parts = piece.translate(None, _NOT_STRUCTURE).split(b'"')
        quotes = len(parts) - 1
        values += (quotes + (0 if inside else 1)) // 2  # strings opened in this slice
        outside = b"".join(parts[1 if inside else 0 :: 2])  # structure between strings
        inside ^= quotes % 2 == 1
        values += len(outside)  # commas and brackets: about one per value
        if values > max_items:
            raise JSONTooLarge(f"{what} holds over {max_items} JSON values (the limit)")
        if len(outside) != outside.count(b","):
            run = list(accumulate(array("b", outside.translate(_STEP)), initial=depth))
            deepest, depth = max(deepest, max(run)), run[-1]
            if deepest > max_depth:
                raise JSONTooLarge(f"{what} nests over {max_depth} levels deep (the limit)")


def loads(text: str, field: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` (a client's string field holding JSON) parsed, or InvalidRequest naming
    ``field``: not JSON, or over :data:`MAX_ITEMS` values / ``max_depth`` levels."""
    shown = text if len(text) <= 64 else f"<{len(text)} chars>"
    try:
        data = text.encode("utf-8", "surrogatepass")
        check_structure(data, max_depth=max_depth, what="the JSON text")
        return json.loads(text)
    except JSONTooLarge as exc:
        raise InvalidRequest(field, shown, str(exc)) from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(field, shown, f"is not JSON: {exc}") from None
