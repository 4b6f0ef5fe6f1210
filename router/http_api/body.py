"""Request bodies, bounded before they are parsed: size, JSON items, nesting.

``json.loads`` runs in C holding the GIL, so no thread keeps it off the event loop: what
bounds its cost is the number of JSON values it builds. :func:`check_structure` counts the
body's values and its nesting with bytes operations only (no per-byte Python), before any
parse (:mod:`kvstore.blocks.json_text`, which bounds JSON inside string fields too); large
bodies are then parsed (and their requests built) in a thread of their own, where
Python-level validation yields the GIL every few milliseconds.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from kvstore.blocks import json_text
from kvstore.blocks.errors import InvalidRequest
from router.http_api.defaults import BODY_TIMEOUT_S
from router.serving.request_errors import BadBody, BodiesBusy, BodyTimeout, BodyTooLarge

SLICE_BYTES = json_text.SLICE_BYTES
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff in a JSON text


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_bytes: int  # router.max_message_bytes
    max_items: int = json_text.MAX_ITEMS  # JSON values (see kvstore.blocks.json_text)
    max_depth: int = json_text.MAX_DEPTH  # nested lists / objects
    timeout_s: float = BODY_TIMEOUT_S  # for the whole body, once the head has arrived
    inline_bytes: int = 64 << 10  # bodies up to this are parsed on the event loop
    budget: BodyBudget | None = None  # the bytes all requests' bodies may hold together


class BodyBudget:
    """The bytes of request bodies held at once (being read or parsed), all requests
    together, bounded: each body is, yet a few hundred clients uploading large ones slowly
    (each may take ``timeout_s``) would otherwise hold gigabytes of the router's memory."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    def take(self, n: int) -> None:
        if self.held + n > self.max_bytes:
            raise BodiesBusy(
                f"the router holds {self.held} bytes of request bodies, its limit for all "
                f"requests together is {self.max_bytes}; retry later"
            )
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n
        assert self.held >= 0, self.held


@asynccontextmanager
async def read_body(request: Request, limits: BodyLimits) -> AsyncIterator[list[bytes]]:
    """The body's chunks as they came (joined by the parser: for a large body, in its
    thread; a 4 MB copy is not free on a busy machine); they count against
    ``limits.budget`` until the block ends."""
    limit, budget = limits.max_bytes, limits.budget
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(
            f"request body of {declared} bytes is over the limit of {limit} bytes "
            "(router.max_message_bytes)"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        try:
            async with asyncio.timeout(limits.timeout_s):
                async for chunk in request.stream():
                    if size + len(chunk) > limit:
                        raise BodyTooLarge(
                            f"request body is over the limit of {limit} bytes "
                            "(router.max_message_bytes)"
                        )
                    if budget is not None:
                        budget.take(len(chunk))
                    size += len(chunk)
                    chunks.append(chunk)
        except TimeoutError:
            raise BodyTimeout(
                f"request body not received within {limits.timeout_s:g} s ({size} bytes came)"
            ) from None
        yield chunks
    finally:
        if budget is not None:
            budget.give(size)


def check_structure(data: bytes, limits: BodyLimits) -> None:
    """Refuse a body with more JSON values or deeper nesting than ``limits`` allow, from its
    bytes alone (:func:`kvstore.blocks.json_text.check_structure`)."""
    try:
        json_text.check_structure(
            data, max_items=limits.max_items, max_depth=limits.max_depth, what="request body"
        )
    except json_text.JSONTooLarge as exc:
        raise BodyTooLarge(str(exc)) from None


def decode_utf8(data: bytes) -> str:
    """Strict UTF-8 (a raw surrogate such as ED A0 80 is not UTF-8), in slices as above."""
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        parts = [dec.decode(data[at : at + SLICE_BYTES]) for at in range(0, len(data), SLICE_BYTES)]
        parts.append(dec.decode(b"", final=True))
    except UnicodeDecodeError:
        raise BadBody("request body is not valid JSON: not UTF-8") from None
    return "".join(parts)


def parse_json(data: bytes, limits: BodyLimits) -> Any:
    """The body as JSON, or :class:`BadBody` / :class:`BodyTooLarge` / InvalidRequest (a
    string that is not valid Unicode, naming where)."""
    text = decode_utf8(data)
    check_structure(data, limits)
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadBody(f"request body is not valid JSON: {exc}") from None
    escaped = any(  # in slices, as above (a match may straddle two: they overlap)
        SURROGATE_ESCAPE.search(data, at, at + SLICE_BYTES + 8)
        for at in range(0, len(data), SLICE_BYTES)
    )
    if escaped:  # "\ud800" decodes to a string with no UTF-8 form
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
