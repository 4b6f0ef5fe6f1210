"""HTTP connections: uvicorn's connection protocols with the router's own bounds on what a
connection may hold before the application sees a request.

uvicorn waits forever for a request's head and, with httptools, buffers a head of any size;
it caps connections only with a plain-text 503 (``limit_concurrency``). Here, per connection:

* a connection with no request under way is closed :attr:`ConnectionLimits.head_timeout_s` after
  it connected or after its last response (idle or trickling sockets would pile up until the
  router's process ran out of file descriptors, gRPC included);
* a request head over :attr:`ConnectionLimits.max_head_bytes` is answered 431 and the connection
  closed (h11 has the same bound on its own, answered 400);
* a connection accepted while :attr:`ConnectionLimits.max_connections` are open is answered at its
  first request by the server's busy answer (the HTTP app's: an OpenAI 503 ``server_busy``
  with ``Retry-After``, counted in ``/metrics``; its body read first with :func:`drain`,
  so the answer is not lost to a reset), and closed; it has :data:`BUSY_HEAD_TIMEOUT_S` to
  send that request.

And per request, an answer's head and its first body write (the first SSE event, a JSON
body) leave as one packet (:class:`_HeadWithBody`): uvicorn writes them separately, and with
Nagle off each write is a packet and a system call on both ends.

httptools (llhttp, in C) is the default parser: per streamed token it costs a fraction of
h11's pure-Python state machine; h11 stays selectable (``http_protocol="h11"``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.http_api.defaults import HEAD_TIMEOUT_S, MAX_CONNECTIONS

log = logging.getLogger(__name__)
HttpProtocol = Literal["httptools", "h11"]
# an over-cap connection is answered if its request comes this soon, else closed unanswered
BUSY_HEAD_TIMEOUT_S = 2.0
MAX_HEAD_BYTES = 16 << 10  # request line and headers (h11's own default bound)
FD_RESERVE = 256  # descriptors beside the HTTP connections (gRPC, Ray, Redis, files)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    head_timeout_s: float = HEAD_TIMEOUT_S  # for a request's head, from connect or last answer
    max_head_bytes: int = MAX_HEAD_BYTES
    max_connections: int = MAX_CONNECTIONS  # open ones (router.http_max_connections)


async def drain(receive: Any, timeout_s: float) -> None:
    """Read a request's body to its end (discarded), for at most ``timeout_s``: an answer
    sent before the client's body was read, then closed, can be lost to a reset."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect" or not msg.get("more_body"):
                    return
    except TimeoutError:
        pass


def _head_too_large(limit: int) -> bytes:
    body = {
        "error": {
            "message": f"request head (request line and headers) is over {limit} bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    data = json.dumps(body).encode()
    head = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(data)
    )
    return head + data


class _HeadWithBody:
    """A request cycle's view of its connection's transport: the first write (the answer's
    head) is held until the next write of the same loop iteration (its first body chunk)
    and sent with it, or at the end of the iteration when none comes; later writes pass
    straight through."""

    __slots__ = ("_transport", "_held")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = b""  # b"": nothing written yet; None: passing through

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self._transport.write(data)
        elif not held:
            self._held = bytes(data)
            asyncio.get_running_loop().call_soon(self.flush)
        else:
            self._held = None
            self._transport.write(held + data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Bounds:
    """What both protocols add (mixed in before uvicorn's protocol class)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    # the ASGI app answering every request of an over-cap connection (its answer must say
    # ``connection: close``); set by :func:`protocol_class`
    busy: ClassVar[Any] = None
    _head_timer: asyncio.TimerHandle | None = None
    _over_cap = False

    # (uvicorn's attributes, for the type checker)
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    connections: set[Any]
    cycle: Any
    app: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.limits.max_connections:
            self._over_cap = True
            self.app = self.busy  # every request of this connection: answered busy
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        cycle = self.cycle  # a request that began in these bytes: its answer not begun yet
        if cycle is not None and not isinstance(cycle.transport, _HeadWithBody):
            if not cycle.response_started:
                cycle.transport = _HeadWithBody(cycle.transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        wait = BUSY_HEAD_TIMEOUT_S if self._over_cap else self.limits.head_timeout_s
        self._head_timer = self.loop.call_later(wait, self._head_late)

    def _head_late(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():
            self.transport.close()


class BoundedHttpTools(_Bounds, HttpToolsProtocol):
    """uvicorn's httptools protocol with the connection bounds; a head is counted in the bytes
    fed while it is incomplete (llhttp itself buffers header fields without a bound)."""

    _in_head = False
    _head_bytes = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head:  # all of data is head bytes: the head did not end in it
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes and not self.transport.is_closing():
                self.transport.write(_head_too_large(self.limits.max_head_bytes))
                self.transport.close()


class BoundedH11(_Bounds, H11Protocol):
    """uvicorn's h11 protocol with the connection bounds (h11 bounds the head itself)."""


def protocol_class(
    kind: HttpProtocol, limits: ConnectionLimits, busy: Any
) -> type[asyncio.Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits``;
    ``busy``: the ASGI app that answers an over-cap connection."""
    base = {"httptools": BoundedHttpTools, "h11": BoundedH11}[kind]
    return type(base.__name__, (base,), {"limits": limits, "busy": staticmethod(busy)})


def make_room_for(max_connections: int) -> int:
    """Raise this process's soft limit on open files to fit ``max_connections`` (up to the
    hard limit); warns when it cannot. Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        top = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if top > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
            soft = top
        if soft < need:
            log.warning(
                "router.http_max_connections=%d needs about %d open files, the process may "
                "open %d (ulimit -n): connections past about %d fail at accept",
                max_connections,
                need,
                soft,
                soft - FD_RESERVE,
            )
    return soft
