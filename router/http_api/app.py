"""The OpenAI-compatible HTTP edge: Starlette routes served by uvicorn in the router actor's
event loop, a thin parser over the same :class:`Intake` as the gRPC servicer.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (SSE
when ``stream``), ``GET`` / ``DELETE /v1/responses/{id}`` (kept responses),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``,
``GET /metrics`` (Prometheus text), ``GET /version``, ``GET /health``, and with
``router.runtime_lora`` ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``. Errors are
OpenAI-shaped (``{"error": {...}}``) with the status of the one error table
(:mod:`router.serving.request_errors`). Bodies are bounded in bytes, values and nesting before they
are parsed, and large ones are parsed off the event loop (:mod:`router.http_api.body`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvstore.adapter_registry import AdapterRegistry
from router.http_api import routes
from router.http_api.body import BodyBudget, BodyLimits, parse_json, read_body
from router.http_api.connections import (
    MAX_HEAD_BYTES,
    ConnectionLimits,
    HttpProtocol,
    drain,
    make_room_for,
    protocol_class,
)
from router.http_api.defaults import (
    BODY_TIMEOUT_S,
    CHEAP_MAX_WAITING,
    CHEAP_RATE_PER_S,
    HEAD_TIMEOUT_S,
    MAX_CONNECTIONS,
)
from router.http_api.generation import WORKER_HEADER, error_response, unless_gone
from router.http_api.generation_routes import GenerationRoutes
from router.http_api.lora_admin import LoraAdmin
from router.http_api.probe_gate import ProbeGate
from router.http_api.response_store import ResponseStore
from router.serving.edge_intake import Intake
from router.serving.request_errors import NoRoute, NotAllowed, ServerBusy
from router.serving.tokenizing import TokenizerPool

__all__ = ["WORKER_HEADER", "OpenAIServer", "error_status"]
log = logging.getLogger(__name__)
# (HEAD_TIMEOUT_S, BODY_TIMEOUT_S: router.http_api.defaults; read here at start and per body)
# Request bodies the router holds at once, all requests together (each is bounded by
# router.max_message_bytes; the budget is at least four of those).
BODY_BUDGET_BYTES = 256 << 20


def error_status(exc: BaseException) -> Any:
    """The error table's answer for ``exc`` (its ``http_status``, ``kind``, ``param``)."""
    from router.serving.request_errors import classify

    return classify(exc)


class OpenAIServer:
    """The HTTP edge of one router (a plain class; the router actor owns it)."""

    def __init__(
        self,
        intake: Intake,
        *,
        max_body_bytes: int,
        close_intake: bool = False,
        cors_origins: Sequence[str] = (),
        max_connections: int = MAX_CONNECTIONS,
        cheap_rate_per_s: float = CHEAP_RATE_PER_S,
        cheap_max_waiting: int = CHEAP_MAX_WAITING,
        http_protocol: HttpProtocol = "httptools",
        responses_store: ResponseStore | None = None,
        runtime_lora: bool = False,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        """``intake``: the router's front door (auth, limits, tokenizer), shared with its gRPC
        edge; ``close_intake``: :meth:`stop` closes it too (a server that is its only user);
        ``responses_store``: where /v1/responses keeps responses (None: none is kept);
        ``runtime_lora``: serve the run-time LoRA routes, which keep adapters in
        ``adapters`` (the cluster's registry; None: no Redis)."""
        self._close_intake = close_intake
        self.responses_store = responses_store
        self.intake = intake
        self.core = intake.core
        self.tokenizer = intake.tokenizer
        self.limits = intake.limits
        self.max_body_bytes = max_body_bytes
        self._parse = ThreadPoolExecutor(1, thread_name_prefix="http-parse")
        self.bodies = BodyBudget(max(BODY_BUDGET_BYTES, 4 * max_body_bytes))
        self.max_connections = max_connections
        self.http_protocol = http_protocol
        self.probe_gate = ProbeGate(cheap_rate_per_s, cheap_max_waiting)
        self.handlers = routes.Handlers(self)
        generation = GenerationRoutes(self)
        self.lora_admin = LoraAdmin(self, adapters, runtime_lora)
        # generation skips Starlette's routing and its two middleware layers, each of
        # which wraps ``send``: three Python calls per streamed event (Starlette still
        # routes its paths' other methods: 405)
        self._generation = {
            "/v1/completions": generation.completions,
            "/v1/chat/completions": generation.chat,
            "/v1/responses": generation.responses,
        }
        every = [
            *(Route(path, h, methods=["POST"]) for path, h in self._generation.items()),
            # kept responses: cheap reads of the response store
            Route(
                "/v1/responses/{response_id}", generation.kept_response, methods=["GET", "DELETE"]
            ),
            Route("/v1/load_lora_adapter", self.lora_admin.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.lora_admin.unload, methods=["POST"]),
            *routes.routes(self),
        ]
        self._routes = Starlette(
            routes=every, exception_handlers={404: self._not_found, 405: self._not_allowed}
        )
        # the POST routes do the client's work (generation, tokenize, detokenize): bounded
        # by the queues and the tokenizer's budget, never by the cheap routes' gate
        self._work = frozenset(
            r.path for r in every if isinstance(r, Route) and "POST" in (r.methods or ())
        )
        self._probes = routes.probe_routes(self)
        self.app: Any = self._dispatch
        if cors_origins:  # off unless origins are configured (router.cors_allowed_origins)
            self.app = CORSMiddleware(
                self._dispatch,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["authorization", "content-type", "x-request-id"],
                expose_headers=[WORKER_HEADER, "x-request-id"],
            )
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    @property
    def tokenize(self) -> TokenizerPool:
        return self.intake.tokenize

    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.max_body_bytes, timeout_s=BODY_TIMEOUT_S, budget=self.bodies)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(
        self, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None
    ) -> int:
        """Serve in the running event loop; returns the bound port (``port`` 0: a free one).
        ``tls_cert`` and ``tls_key`` (PEM files, both or neither): serve HTTPS."""
        tls = bool(tls_cert and tls_key)
        make_room_for(self.max_connections)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
        # so, and accepted ones inherit it; with Nagle on, an answer's second write (the
        # body after the head, each SSE event) waited for the client's delayed ACK, 40 ms
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            interface="asgi3",  # (a bound method is not recognised as one)
            http=protocol_class(
                self.http_protocol,
                ConnectionLimits(
                    head_timeout_s=HEAD_TIMEOUT_S, max_connections=self.max_connections
                ),
                self._over_cap,
            ),
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            proxy_headers=False,  # nothing reads the client's address
            timeout_graceful_shutdown=2,
            ssl_certfile=tls_cert if tls else None,
            ssl_keyfile=tls_key if tls else None,
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind/start error
                raise RuntimeError("HTTP server exited during start")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._server = self._task = None
        self._parse.shutdown(wait=False, cancel_futures=True)
        if self._close_intake:
            self.intake.close()
        if self.responses_store is not None:
            self.responses_store.close()
        if self.lora_admin.registry is not None:
            self.lora_admin.registry.close()

    async def _dispatch(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI application: generation straight to its handler; every request that
        carries no work of the client's (probes, models, metrics, a wrong path or method)
        through the cheap routes' gate first; the rest routed."""
        if scope["type"] != "http":
            return await self._routes(scope, receive, send)
        path, method = scope["path"], scope["method"]
        request = Request(scope, receive)
        if method == "POST" and path in self._work:
            handler = self._generation.get(path)  # (tokenize, detokenize: routed)
        else:
            try:
                if not self.probe_gate.admit_now():
                    # its turn may be seconds away: a client that leaves meanwhile is not
                    # served (nor is its place held)
                    if await unless_gone(request, self.probe_gate.admit()) is None:
                        return None
            except ServerBusy as exc:
                return await self.error(exc)(scope, receive, send)
            handler = self._probes.get(path) if method in ("GET", "HEAD") else None
        if handler is None:
            return await self._routes(scope, receive, send)
        response = await handler(request)
        await response(scope, receive, send)

    async def _over_cap(self, scope: Any, receive: Any, send: Any) -> None:
        """The answer to every request of a connection accepted past the connection cap
        (:mod:`router.http_api.connections`): its body read first, then a 503 ``server_busy``
        from the error table (counted), and the connection closed."""
        await drain(receive, BODY_TIMEOUT_S)
        busy = ServerBusy(
            f"the router has {self.max_connections} open HTTP connections, its limit "
            "(router.http_max_connections); retry later"
        )
        await self.error(busy, headers={"connection": "close"})(scope, receive, send)

    # -- shared by the routes -------------------------------------------------------------

    def error(
        self, exc: BaseException, names: Any = None, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        return error_response(exc, names, self.intake, headers)

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        return self.error(NoRoute(f"no route {request.url.path}"))

    async def _not_allowed(self, request: Request, exc: Exception) -> JSONResponse:
        return self.error(NotAllowed(f"{request.method} not allowed on {request.url.path}"))

    def tenant(self, request: Request) -> str | None:
        return self.intake.tenant(request.headers)

    async def json_body(self, request: Request, parse: Any = None) -> Any:
        """The body, bounded before parsing; ``parse(body)`` runs where the JSON was parsed
        (a thread of its own for a large body) and its result is returned instead."""
        limits = self.body_limits()
        async with read_body(request, limits) as chunks:  # held until parsed

            def work() -> Any:
                body = parse_json(b"".join(chunks), limits)
                return parse(body) if parse is not None else body

            if sum(map(len, chunks)) <= limits.inline_bytes:
                return work()
            return await asyncio.get_running_loop().run_in_executor(self._parse, work)
