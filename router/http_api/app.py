"""The OpenAI-compatible HTTP edge: Starlette routes served by uvicorn in the router actor's
event loop, over the same :class:`ServingCore` as the gRPC servicer.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``),
``GET /v1/models``, ``GET /health``. Errors are OpenAI-shaped (``{"error": {...}}``) with the
status from :func:`error_status`. A client that goes away, before or during its stream,
cancels the generation, and the serving core aborts the request on its worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import uvicorn
from ray.exceptions import RayTaskError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvstore.blocks.errors import EngineOverloaded, InvalidRequest
from kvstore.blocks.outputs import GenerationResult, RequestOutput
from router.edge.convert import GenerateSpec, chat_token_ids
from router.edge.servicer import RequestFailed, TokenAuth
from router.edge.tokenizing import TokenizerPool, check_chat_chars, check_text_chars
from router.http_api.protocol import (
    SURROGATE_ESCAPE,
    OpenAIRequest,
    parse_request,
    shown,
    surrogate_path,
    to_specs,
)
from router.http_api.responses import Shaper
from router.placement.adapters import adapter_name
from router.placement.config import RequestLimits
from router.placement.types import NoWorkersError
from router.serving.core import ClusterOverloaded, ServingCore, StreamBroken
from worker.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
WORKER_HEADER = "x-kvcluster-worker"
# A client has this long for a request's head (from connecting, or from its last answer)
# and then for its body: uvicorn waits forever on either, so idle or trickling sockets
# could pile up until the router's process runs out of file descriptors, gRPC included.
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0


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


class HTTPError(Exception):
    """An error with its HTTP status, OpenAI error type and (optional) parameter."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param, self.code = (
            status,
            kind,
            message,
            param,
            code,
        )


def error_status(exc: BaseException) -> HTTPError:
    """The one place where errors become HTTP statuses (as ``_status_of`` is for gRPC)."""
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, Exception):
        exc = exc.cause  # raised on the worker: its own message, not Ray's traceback
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidRequest):
        return HTTPError(400, "invalid_request_error", str(exc), exc.field)
    if isinstance(exc, EngineOverloaded | ClusterOverloaded):
        return HTTPError(429, "rate_limit_error", str(exc), code="queues_full")
    if isinstance(exc, NoWorkersError | StreamBroken):
        return HTTPError(503, "service_unavailable", str(exc))
    if isinstance(exc, RequestFailed):
        return HTTPError(500, "internal_error", str(exc))
    log.error("internal error serving an HTTP request", exc_info=exc)
    return HTTPError(500, "internal_error", f"internal error: {type(exc).__name__}")


def error_body(err: HTTPError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }


def _error_response(exc: BaseException) -> JSONResponse:
    err = error_status(exc)
    return JSONResponse(error_body(err), status_code=err.status)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """SSE that also watches for the client leaving while no event is due (a request still
    queued, a long prefill): Starlette's own response notices only when a send fails."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (body, gone):
                t.cancel()
            await asyncio.gather(body, gone, return_exceptions=True)


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


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
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        # the gRPC servicer's pools when given: one router, one budget of tokenizer threads
        self._own_pools = tokenize is None  # closed by stop() only if this server made them
        self.tokenize = tokenize or TokenizerPool(tokenizer)
        self.auth = auth
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

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
        if self._own_pools:
            self.tokenize.close()

    # -- small routes -------------------------------------------------------------------

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        return _error_response(HTTPError(404, "not_found_error", f"no route {request.url.path}"))

    async def _not_allowed(self, request: Request, exc: Exception) -> JSONResponse:
        return _error_response(
            HTTPError(
                405, "invalid_request_error", f"{request.method} not allowed on {request.url.path}"
            )
        )

    async def _health(self, request: Request) -> Response:
        live = await self.core.directory.candidates()
        if not live:
            return _error_response(HTTPError(503, "service_unavailable", "no live worker"))
        return JSONResponse({"status": "ok", "live_workers": len(live)})

    def _tenant(self, request: Request) -> str | None:
        if self.auth is None:
            return None
        tenant = self.auth.tenant_of([("authorization", request.headers.get("authorization", ""))])
        if tenant is None:
            raise HTTPError(
                401,
                "authentication_error",
                "missing or invalid bearer token (header 'Authorization: Bearer ...')",
                code="invalid_api_key",
            )
        return tenant

    async def _adapters(self) -> list[str]:
        loads = await self.core.directory.candidates()
        return sorted({adapter_name(i) for ld in loads.values() for i in ld.lora_ids})

    async def _models(self, request: Request) -> Response:
        try:
            self._tenant(request)
            adapters = await self._adapters()
        except Exception as exc:
            return _error_response(exc)
        base = self.core.limits.model_id
        data = [
            {
                "id": base,
                "object": "model",
                "created": 0,
                "owned_by": "kvcluster",
                "max_model_len": self.core.limits.max_model_len,
            }
        ]
        data += [
            {"id": a, "object": "model", "created": 0, "owned_by": "kvcluster", "parent": base}
            for a in adapters
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _lora_of(self, model: str) -> str | None:
        """``model`` is the base model (None) or an adapter a live worker serves."""
        if model == self.core.limits.model_id:
            return None
        if model in await self._adapters():
            return model
        raise HTTPError(
            404,
            "invalid_request_error",
            f"model {shown(model)!r} does not exist; GET /v1/models lists the served ones",
            param="model",
            code="model_not_found",
        )

    # -- generation ---------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _read_json(self, request: Request) -> Any:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise HTTPError(
                413,
                "invalid_request_error",
                f"request body of {declared} bytes is over the limit of {limit} "
                "bytes (router.max_message_bytes)",
            )
        chunks, size = [], 0
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise HTTPError(
                            413,
                            "invalid_request_error",
                            f"request body is over the limit of {limit} bytes "
                            "(router.max_message_bytes)",
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise HTTPError(
                408,
                "invalid_request_error",
                f"request body not received within {BODY_TIMEOUT_S:g} s ({size} bytes came)",
            ) from None
        data = b"".join(chunks)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise HTTPError(
                400, "invalid_request_error", f"request body is not valid JSON: {exc}"
            ) from None
        bad = surrogate_path(body) if SURROGATE_ESCAPE.search(data) else None
        if bad is not None:  # a pair of escapes is one valid character: not an error
            raise InvalidRequest(
                shown(bad.removeprefix("body.")),
                "<text>",
                "is not valid Unicode (it holds a lone surrogate such as \\ud800)",
            )
        return body

    async def _prepare(
        self, request: Request, chat: bool
    ) -> tuple[OpenAIRequest, list[GenerateSpec], list[list[int]]]:
        tenant = self._tenant(request)  # first: an unauthenticated caller learns nothing
        body = await self._read_json(request)
        meta, reqs = parse_request(
            body, chat=chat, tenant=tenant, limits=self.limits, now=int(time.time())
        )
        lora = await self._lora_of(meta.model)
        specs = to_specs(reqs, tenant=tenant, lora=lora, limits=self.limits)
        token_lists = [await self._token_ids(s) for s in specs]
        if chat and not reqs[0].params.HasField("max_tokens"):
            # OpenAI's chat default: as long as the context allows
            room = max(1, self.core.limits.max_model_len - len(token_lists[0]))
            specs = [replace(specs[0], params=replace(specs[0].params, max_tokens=room))]
        return meta, specs, token_lists

    async def _token_ids(self, spec: GenerateSpec) -> list[int]:
        """As the gRPC servicer does: off the event loop, long texts apart, and a text too
        long for the model refused before it is tokenized."""
        if spec.messages is not None:
            chars = check_chat_chars(spec.messages, self.limits, self.core.limits.max_model_len)
            return await self.tokenize.run(
                chars, chat_token_ids, self.tokenizer, spec.messages, spec.tools
            )
        if spec.token_ids is not None:
            return spec.token_ids
        # refused before any work is spent on it, as on the gRPC edge
        check_text_chars("prompt", spec.text, self.limits, self.core.limits.max_model_len)
        return await self.tokenize.encode(spec.text)

    async def _one(
        self, spec: GenerateSpec, ids: list[int]
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        async for worker, out in self.core.generate(spec.request_id, ids, spec.params):
            if out.error is not None:  # it failed inside the engine (the engine goes on)
                raise RequestFailed(f"request {out.request_id!r} failed on {worker}: {out.error}")
            yield worker, out

    async def _outputs(
        self, specs: Sequence[GenerateSpec], token_lists: Sequence[list[int]]
    ) -> AsyncIterator[tuple[int, str, RequestOutput]]:
        """(prompt index, worker, output) of every prompt as they come; closing this (or an
        error in one prompt) cancels the others, and the core aborts each on its worker."""
        if len(specs) == 1:
            async for worker, out in self._one(specs[0], token_lists[0]):
                yield 0, worker, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int) -> None:
            try:
                async for worker, out in self._one(specs[i], token_lists[i]):
                    queue.put_nowait((i, worker, out))
            except Exception as exc:
                queue.put_nowait((i, None, exc))
            finally:
                queue.put_nowait((i, None, done))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(specs))]
        try:
            running = len(tasks)
            while running:
                i, worker, item = await queue.get()
                if item is done:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, worker, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            meta, specs, token_lists = await self._prepare(request, chat)
        except Exception as exc:
            return _error_response(exc)
        shaper = Shaper(meta, specs[0].params.n, self.tokenizer)
        outputs = self._outputs(specs, token_lists)
        # the first output before any header: it names the worker, and an error before it
        # (full queues, no worker) still gets its own status code
        try:
            first = await self._unless_gone(request, anext(outputs))
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            await outputs.aclose()
            return _error_response(exc)
        if first is None:  # client gone (or nothing produced): nothing to answer
            await outputs.aclose()
            return Response(status_code=499)
        headers = {WORKER_HEADER: first[1], "x-request-id": meta.response_id}
        if meta.stream:
            return _EventStream(
                self._events(shaper, first, outputs),
                headers=headers,
                media_type="text/event-stream",
            )
        try:
            result = await self._unless_gone(request, self._collect(shaper, first, outputs))
        except Exception as exc:
            return _error_response(exc)
        finally:
            await outputs.aclose()
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result, headers=headers)

    async def _unless_gone(self, request: Request, awaitable: Any) -> Any:
        """``awaitable``'s result, or None when the client disconnects first (it is then
        cancelled, which aborts its requests)."""
        work = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
        if work.cancelled():
            await asyncio.gather(work, return_exceptions=True)
            return None
        return work.result()

    async def _collect(
        self,
        shaper: Shaper,
        first: tuple[int, str, RequestOutput],
        rest: AsyncIterator[tuple[int, str, RequestOutput]],
    ) -> dict[str, Any]:
        results: dict[int, GenerationResult] = {}

        def add(item: tuple[int, str, RequestOutput]) -> None:
            i, _, out = item
            results.setdefault(i, GenerationResult(out.request_id, [])).add(out)

        add(first)
        async for item in rest:
            add(item)
        completions = [(i, c) for i, r in sorted(results.items()) for c in r.completions]
        usages = [r.usage for _, r in sorted(results.items()) if r.usage is not None]
        return shaper.whole(completions, usages)

    async def _events(
        self,
        shaper: Shaper,
        first: tuple[int, str, RequestOutput],
        rest: AsyncIterator[tuple[int, str, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        usages: dict[int, Any] = {}
        started: set[int] = set()

        def chunks(item: tuple[int, str, RequestOutput]) -> list[bytes]:
            i, _, out = item
            usages[i] = out.usage
            out_chunks = []
            for d in out.outputs:
                key = i * shaper.n + d.index
                out_chunks.append(_sse(shaper.chunk(i, d, key not in started)))
                started.add(key)
            return out_chunks

        try:
            for c in chunks(first):
                yield c
            async for item in rest:
                for c in chunks(item):
                    yield c
            if shaper.req.include_usage:
                yield _sse(shaper.usage_chunk(list(usages.values())))
        except Exception as exc:  # headers are sent: the error goes in the stream
            yield _sse(error_body(error_status(exc)))
        finally:
            await rest.aclose()  # aborts what is still running (client gone)
        yield _sse("[DONE]")
