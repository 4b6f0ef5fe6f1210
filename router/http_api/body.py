"""Request bodies, bounded before they are parsed: size, JSON items, nesting.

``json.loads`` runs in C holding the GIL, so no thread keeps it off the event loop: what
bounds its cost is the number of JSON values it builds. :func:`check_structure` counts the
body's values and its nesting with bytes operations only (no per-byte Python), before any
parse; large bodies are then parsed (and their requests built) in a thread of their own,
where Python-level validation yields the GIL every few milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import re
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from starlette.requests import Request

from kvstore.blocks.errors import InvalidRequest
from router.serving.errors import BadBody, BodyTimeout, BodyTooLarge

_STRUCTURE = b',[]{}"'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_STEP = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff in a JSON text


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_bytes: int  # router.max_message_bytes
    max_items: int = 1 << 17  # JSON values (strings, numbers, lists, objects, members)
    max_depth: int = 32  # nested lists / objects
    timeout_s: float = 30.0  # for the whole body, once the head has arrived
    inline_bytes: int = 64 << 10  # bodies up to this are parsed on the event loop


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    limit = limits.max_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(
            f"request body of {declared} bytes is over the limit of {limit} bytes "
            "(router.max_message_bytes)"
        )
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(
                        f"request body is over the limit of {limit} bytes "
                        "(router.max_message_bytes)"
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(
            f"request body not received within {limits.timeout_s:g} s ({size} bytes came)"
        ) from None
    return b"".join(chunks)


def check_structure(data: bytes, limits: BodyLimits) -> None:
    """Refuse a body with more JSON values or deeper nesting than ``limits`` allow, from its
    bytes alone (strings' contents do not count: a prompt full of commas is one value)."""
    bare = data.replace(b"\\\\", b"").replace(b'\\"', b"")  # now every '"' opens or closes
    strings = bare.count(b'"') // 2
    if strings > limits.max_items:
        raise _too_many(f"over {limits.max_items} strings", limits)
    parts = bare.translate(None, _NOT_STRUCTURE).split(b'"')
    outside = b"".join(parts[0::2])  # the structure: commas and brackets between strings
    items = strings + len(outside)
    if items > limits.max_items:
        raise _too_many(f"about {items} values", limits)
    brackets = len(outside) - outside.count(b",")
    if brackets > limits.max_depth:  # deep enough to matter: find the deepest point
        depth = max(accumulate(array("b", outside.translate(_STEP))), default=0)
        if depth > limits.max_depth:
            raise BodyTooLarge(
                f"request body nests {depth} levels deep, over the limit of {limits.max_depth}"
            )


def _too_many(what: str, limits: BodyLimits) -> BodyTooLarge:
    return BodyTooLarge(
        f"request body holds {what}, over the limit of {limits.max_items} JSON values"
    )


def parse_json(data: bytes, limits: BodyLimits) -> Any:
    """The body as JSON, or :class:`BadBody` / :class:`BodyTooLarge` / InvalidRequest (a
    string that is not valid Unicode, naming where)."""
    try:
        text = data.decode("utf-8")  # strict: a raw surrogate (ED A0 80) is not UTF-8
    except UnicodeDecodeError as exc:
        raise BadBody(f"request body is not valid JSON: not UTF-8 at byte {exc.start}") from None
    check_structure(data, limits)
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadBody(f"request body is not valid JSON: {exc}") from None
    if SURROGATE_ESCAPE.search(data):  # "\ud800" decodes to a string with no UTF-8 form
        bad = surrogate_path(body)
        if bad is not None:  # a pair of escapes is one valid character: not an error
            raise InvalidRequest(
                bad, "<text>", "is not valid Unicode (it holds a lone surrogate such as \\ud800)"
            )
    return body


def surrogate_path(body: Any) -> str | None:
    """Where ``body`` holds a string (value or key) with a lone surrogate, as the field's
    path (``stop[1]``, ``messages[0].content``); None when every string is valid text.
    Linear in the body's values, which :func:`check_structure` bounds; paths are built only
    for the string found."""
    stack: list[tuple[Any, tuple | None]] = [(body, None)]  # (value, (parent path, key))
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode()
                except UnicodeEncodeError:
                    return _path(where)
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, (where, k)))
                stack.append((x, (where, k)))
        elif isinstance(v, list):
            stack.extend(
                (x, (where, i)) for i, x in enumerate(v) if isinstance(x, str | list | dict)
            )
    return None


def _path(where: tuple | None) -> str:
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    out = ""
    for key in reversed(keys):
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            name = key.encode("utf-8", "backslashreplace").decode()  # printable
            name = name if len(name) <= 64 else f"<{len(name)} chars>"
            out += f".{name}" if out else name
    return out or "body"
