"""Typed errors a caller of the engine can act on (the gRPC layer maps them to status codes).

* :class:`InvalidRequest` -> ``INVALID_ARGUMENT``: the request can never be served as given.
* :class:`EngineOverloaded` -> ``RESOURCE_EXHAUSTED``: retry later or elsewhere.
"""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """Base class of the engine's user-facing errors."""


class InvalidRequest(EngineError, ValueError):
    """A request field is out of range; names the field, the value and the limit it broke."""

    def __init__(self, field: str, value: Any, limit: str, hint: str = "") -> None:
        self.field = field  # e.g. "top_p" or "prompt"
        self.value = value  # the offending value (for prompts: their length)
        self.limit = limit  # the rule it broke, e.g. "must be in (0, 1]"
        self.hint = hint
        msg = f"invalid {field}={value!r}: {limit}"
        super().__init__(f"{msg}; {hint}" if hint else msg)

    def __reduce__(self) -> tuple:  # crosses process boundaries (Ray) intact, notes too
        return type(self), (self.field, self.value, self.limit, self.hint), self.__dict__


class EngineOverloaded(EngineError):
    """The waiting queue is full; the request was not queued."""

    def __init__(self, num_waiting: int, max_waiting: int) -> None:
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting
        super().__init__(
            f"engine overloaded: {num_waiting} requests waiting (max_waiting={max_waiting}); "
            "retry later or on another worker"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.num_waiting, self.max_waiting), self.__dict__


class EngineStopped(EngineError):
    """The streaming front was stopped; no new requests are accepted."""


class WireMismatch(EngineError):
    """A peer (router or worker) of another version sent a message this side cannot read
    as meant; it is refused rather than misread."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(
            f"{detail}; routers and workers run different kvcluster versions: "
            "upgrade the older side"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.detail,), self.__dict__


class UnknownChannel(EngineError):
    """A request named an output channel this worker does not know, without its caller:
    the worker was restarted since the router opened the channel (it reopens one)."""
