"""The OpenAI-compatible HTTP edge: Starlette routes served by uvicorn in the router actor's
event loop, a thin parser over the same :class:`Intake` as the gRPC servicer.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``,
``GET /metrics`` (Prometheus text), ``GET /version``, ``GET /health``. Errors are
OpenAI-shaped (``{"error": {...}}``) with the status of the one error table
(:mod:`router.serving.errors`). Bodies are bounded in bytes, values and nesting before they
are parsed, and large ones are parsed off the event loop (:mod:`router.http_api.body`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.http_api import routes
from router.http_api.body import BodyBudget, BodyLimits, parse_json, read_body
from router.http_api.generation import WORKER_HEADER, Generation, error_response
from router.http_api.protocol import OpenAIRequest, known_fields, parse_request
from router.http_api.responses import Shaper
from router.placement.config import RequestLimits
from router.serving.auth import TokenAuth
from router.serving.core import ClusterOverloaded, ServingCore
from router.serving.errors import NoRoute, NotAllowed
from router.serving.intake import Intake
from router.serving.request import GenerateSpec
from router.serving.tokenizing import TokenizerPool
from worker.model.tokenizer import Tokenizer

__all__ = ["WORKER_HEADER", "OpenAIServer", "error_status"]
log = logging.getLogger(__name__)
# A client has this long for a request's head (from connecting, or from its last answer)
# and then for its body: uvicorn waits forever on either, so idle or trickling sockets
# could pile up until the router's process runs out of file descriptors, gRPC included.
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
# Request bodies the router holds at once, all requests together (each is bounded by
# router.max_message_bytes; the budget is at least four of those).
BODY_BUDGET_BYTES = 256 << 20


class _DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has no request under way
    :data:`HEAD_TIMEOUT_S` after it connected or after its last response (a request whose
    head has arrived is past this; its body has :data:`BODY_TIMEOUT_S`)."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def _head_late(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():
            self.transport.close()


def error_status(exc: BaseException) -> Any:
    """The error table's answer for ``exc`` (its ``http_status``, ``kind``, ``param``)."""
    from router.serving.errors import classify

    return classify(exc)


class OpenAIServer:
    """The HTTP edge of one router (a plain class; the router actor owns it)."""

    def __init__(
        self,
        core: ServingCore,
        tokenizer: Tokenizer,
        *,
        auth: TokenAuth | None,
        limits: RequestLimits,
        max_body_bytes: int,
        tokenize: TokenizerPool | None = None,
        intake: Intake | None = None,
        cors_origins: Sequence[str] = (),
    ) -> None:
        self._own_intake = intake is None  # closed by stop() only if this server made it
        self.intake = intake or Intake(core, tokenizer, auth=auth, limits=limits, tokenize=tokenize)
        self.core = core
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self._parse = ThreadPoolExecutor(1, thread_name_prefix="http-parse")
        self.bodies = BodyBudget(max(BODY_BUDGET_BYTES, 4 * max_body_bytes))
        self._logged_fields: set[str] = set()
        middleware = []
        if cors_origins:  # off unless origins are configured (router.cors_allowed_origins)
            middleware.append(
                Middleware(
                    CORSMiddleware,
                    allow_origins=list(cors_origins),
                    allow_methods=["GET", "POST", "OPTIONS"],
                    allow_headers=["authorization", "content-type", "x-request-id"],
                    expose_headers=[WORKER_HEADER, "x-request-id"],
                )
            )
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                *routes.routes(self),
            ],
            middleware=middleware,
            exception_handlers={404: self._not_found, 405: self._not_allowed},
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
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http=_DeadlineH11,
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
        if self._own_intake:
            self.intake.close()

    # -- shared by the routes -------------------------------------------------------------

    def error(self, exc: BaseException, names: Any = None) -> JSONResponse:
        return error_response(exc, names, self.intake)

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

    def note_unknown(self, body: Any, chat: bool) -> None:
        """Unknown fields are ignored (as vLLM does), logged once per name and counted."""
        if not isinstance(body, dict):
            return
        for name in set(body) - known_fields(chat):
            shown = name.encode("unicode_escape").decode()[:64]
            if self.intake.metrics.unknown_field(shown):
                log.warning("ignoring unknown request field %r (logged once per name)", shown)

    # -- generation ---------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _prepare(
        self, request: Request, chat: bool
    ) -> tuple[OpenAIRequest, list[GenerateSpec], list[list[int]]]:
        await self.intake.turn()  # a burst's parsing spread over loop iterations
        tenant = self.tenant(request)  # first: an unauthenticated caller learns nothing
        try:  # then the cheap refusal, before any parsing
            self.core.check_room()
        except ClusterOverloaded:
            async with read_body(request, self.body_limits()):  # drained unparsed: the
                pass  # connection stays usable
            raise
        header_rid = request.headers.get("x-request-id")

        def parse(body: Any) -> tuple[Any, OpenAIRequest, list[GenerateSpec]]:
            meta, specs = parse_request(
                body,
                chat=chat,
                tenant=tenant,
                limits=self.limits,
                now=int(time.time()),
                header_request_id=header_rid,
            )
            return body, meta, specs

        body, meta, specs = await self.json_body(request, parse)
        self.note_unknown(body, chat)
        lora = await self.intake.lora_of(meta.model or None, tenant)
        if not meta.model:
            meta = replace(meta, model=self.intake.model_id)
        if lora is not None:
            specs = [replace(s, params=replace(s.params, lora=lora)) for s in specs]
        token_lists = [await self.intake.token_ids(s) for s in specs]
        if chat and not meta.max_tokens_set:  # OpenAI's chat default: what the context allows
            specs = [self.intake.with_room(specs[0], token_lists[0])]
        return meta, specs, token_lists

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            meta, specs, token_lists = await self._prepare(request, chat)
        except Exception as exc:
            return self.error(exc, {"text": "prompt", "token_ids": "prompt"})
        echoes = None
        if meta.echo:  # the prompt as the client sent it (token ids: their text)
            echoes = [
                s.text if s.text is not None else self.tokenizer.decode(ids)
                for s, ids in zip(specs, token_lists, strict=True)
            ]
        shaper = Shaper(meta, specs[0].params.n, self.tokenizer, echoes, token_lists)
        # the client's X-Request-Id comes back as it was sent; else the answer's id
        headers = {"x-request-id": request.headers.get("x-request-id") or meta.response_id}
        return await Generation(self.intake, shaper, specs, token_lists).answer(request, headers)
