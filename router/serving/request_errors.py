"""The one error table: every error a request can meet -> its gRPC code, HTTP status and
OpenAI error type, and the intake's own error classes.

Both edges map through :func:`classify`; a field named in an :class:`InvalidRequest` is
renamed to the client's spelling with the request's ``names`` (``text`` is ``prompt`` on
the OpenAI API, ``max_tokens`` is ``max_completion_tokens`` when the client sent that).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from ray.exceptions import RayTaskError

from kvstore.requests.errors import EngineOverloaded, InvalidRequest, WireMismatch
from router.placement.placement_types import NoWorkersError
from router.serving.core import FULL_RETRY_S, ClusterOverloaded, StreamBroken

log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """The engine failed this one request (a bug it hit); others were not affected."""


class Unauthenticated(Exception):
    """No valid bearer token."""


class ModelNotFound(Exception):
    """The request names a model (or adapter) no live worker serves."""


class ResponseNotFound(Exception):
    """A stored response the request names does not exist for its tenant (or expired)."""

    def __init__(self, response_id: str, param: str | None = None) -> None:
        self.response_id = response_id
        self.param = param  # the field that named it (None: the path)
        shown = response_id if len(response_id) <= 64 else f"<{len(response_id)} chars>"
        super().__init__(f"no stored response {shown!r} (it may have expired)")

    def __reduce__(self) -> tuple:  # crosses process boundaries intact, notes too
        return type(self), (self.response_id, self.param), self.__dict__


class StoreUnavailable(Exception):
    """A store in the cluster's Redis (kept responses, the adapter registry) did not
    answer; retry later."""


class BadBody(Exception):
    """A request body that does not parse (not JSON, not UTF-8, corrupt protobuf)."""


class BodyTooLarge(Exception):
    """A request body over the size or structure limits, refused before it is parsed."""


class BodiesBusy(Exception):
    """The router holds as many request bodies' bytes as it may (all requests together)."""


class ServerBusy(Exception):
    """An HTTP door limit was reached (cheap routes' rate, open connections); retry later."""


class BodyTimeout(Exception):
    """A request body that did not arrive in time."""


class NoRoute(Exception):
    """HTTP: no such path (or no such object under it)."""


class NotAllowed(Exception):
    """HTTP: the path exists, the method does not."""


@dataclass(frozen=True, slots=True)
class Mapped:
    """How one error is answered on each edge."""

    grpc_code: grpc.StatusCode
    http_status: int
    kind: str  # OpenAI error type
    message: str
    param: str | None = None  # the field, as the client's API spells it
    code: str | None = None  # OpenAI error code
    # when a retry may succeed: HTTP's Retry-After, gRPC's retry pushback (None: no hint)
    retry_after_s: int | None = None


# Full queues and a fleet without a live worker (one restarting, a heartbeat away) clear up
# within about a second; clients that honour the hint (the openai package, gRPC's retry
# policy) wait this long instead of their own first backoff. (The serving core refuses new
# requests unparsed for as long, once every worker's queue was full.)
RETRY_AFTER_S = FULL_RETRY_S


# exception class -> (gRPC code, HTTP status, OpenAI type, OpenAI code); first match wins
_TABLE: tuple[
    tuple[tuple[type[BaseException], ...], grpc.StatusCode, int, str, str | None], ...
] = (
    (
        (Unauthenticated,),
        grpc.StatusCode.UNAUTHENTICATED,
        401,
        "authentication_error",
        "invalid_api_key",
    ),
    ((BadBody,), grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None),
    ((BodyTooLarge,), grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error", None),
    ((BodyTimeout,), grpc.StatusCode.DEADLINE_EXCEEDED, 408, "invalid_request_error", None),
    (
        (BodiesBusy, ServerBusy),
        grpc.StatusCode.UNAVAILABLE,
        503,
        "service_unavailable",
        "server_busy",
    ),
    ((InvalidRequest,), grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None),
    (
        (ModelNotFound,),
        grpc.StatusCode.NOT_FOUND,
        404,
        "invalid_request_error",
        "model_not_found",
    ),
    ((NoRoute,), grpc.StatusCode.UNIMPLEMENTED, 404, "not_found_error", None),
    ((ResponseNotFound,), grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", None),
    ((StoreUnavailable,), grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", None),
    ((NotAllowed,), grpc.StatusCode.UNIMPLEMENTED, 405, "invalid_request_error", None),
    (
        (EngineOverloaded, ClusterOverloaded),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        429,
        "rate_limit_error",
        "queues_full",
    ),
    (
        (NoWorkersError, StreamBroken),
        grpc.StatusCode.UNAVAILABLE,
        503,
        "service_unavailable",
        None,
    ),
    # a router and a worker of different versions: the operator's to fix, said as it is
    (
        (WireMismatch,),
        grpc.StatusCode.UNAVAILABLE,
        503,
        "service_unavailable",
        "version_mismatch",
    ),
    ((asyncio.TimeoutError,), grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", None),
    ((RequestFailed,), grpc.StatusCode.INTERNAL, 500, "internal_error", None),
)


# errors that clear up by themselves (a version mismatch is the operator's to fix)
_RETRYABLE = (
    EngineOverloaded,
    ClusterOverloaded,
    NoWorkersError,
    StreamBroken,
    BodiesBusy,
    ServerBusy,
    StoreUnavailable,
)


def renamed(exc: InvalidRequest, names: Mapping[str, str]) -> InvalidRequest:
    """``exc`` with its field as the client's API spells it."""
    name = names.get(exc.field)
    if name is None:
        head, dot, rest = exc.field.partition(".")  # e.g. "text" inside "messages[0].text"
        name = names[head] + dot + rest if head in names and dot else None
    if name is None or name == exc.field:
        return exc
    return InvalidRequest(name, exc.value, exc.limit, exc.hint)


def classify(exc: BaseException, names: Mapping[str, str] | None = None) -> Mapped:
    """The error's answer on both edges (an unexpected one is logged and hidden)."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, Exception):
        exc = exc.cause  # raised on the worker: its own message, not Ray's traceback
    if isinstance(exc, InvalidRequest) and names:
        exc = renamed(exc, names)
    for classes, code, status, kind, err_code in _TABLE:
        if isinstance(exc, classes):
            param = exc.field if isinstance(exc, InvalidRequest) else None
            if isinstance(exc, ModelNotFound):
                param = "model"
            elif isinstance(exc, ResponseNotFound):
                param = exc.param
            message = str(exc) or type(exc).__name__
            if isinstance(exc, asyncio.TimeoutError):
                message = "deadline exceeded"
            retry = RETRY_AFTER_S if isinstance(exc, _RETRYABLE) else None
            return Mapped(code, status, kind, message, param, err_code, retry)
    log.error("internal error serving a request", exc_info=exc)
    return Mapped(
        grpc.StatusCode.INTERNAL, 500, "internal_error", f"internal error: {type(exc).__name__}"
    )
