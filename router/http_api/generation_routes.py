"""The HTTP edge's generation routes, ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``POST /v1/responses``: a request parsed and tokenized
through the router's :class:`~router.serving.edge_intake.Intake`, answered by a
:class:`~router.http_api.generation.Generation` (SSE when ``stream``). The server calls
them straight, past Starlette's routing (:class:`~router.http_api.app.OpenAIServer`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.http_api.body import read_body
from router.http_api.generation import Generation
from router.http_api.openai_request import known_fields, parse_request
from router.http_api.responses import Shaper
from router.http_api.responses_request import FIELDS as RESPONSES_FIELDS
from router.http_api.responses_request import parse_responses
from router.http_api.responses_shaper import ResponsesShaper
from router.serving.core import ClusterOverloaded
from router.serving.generate_spec import GenerateSpec
from router.serving.request_errors import ResponseNotFound

if TYPE_CHECKING:
    from router.http_api.app import OpenAIServer

log = logging.getLogger("router.http_api.app")  # the server's log, as its other lines


class GenerationRoutes:
    """The generation routes of one server."""

    def __init__(self, server: OpenAIServer) -> None:
        self.s = server

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def responses(self, request: Request) -> Response:
        store = self.s.responses_store

        def parse(
            body: Any, tenant: str | None, rid: str | None, history: Any = None
        ) -> tuple[Any, list[Any]]:
            meta, spec = parse_responses(
                body,
                tenant=tenant,
                limits=self.s.limits,
                now=int(time.time()),
                header_request_id=rid,
                can_store=store is not None,
                history=history,
            )
            return meta, [spec]

        async def with_store(body: Any, tenant: str | None, meta: Any, specs: Any) -> Any:
            """The request with what the store holds for it: the conversation it continues
            (parsed again after it), and whether its tenant may keep one more response."""
            if store is None:
                return meta, specs
            if meta.previous_response_id is not None:
                record = await store.get(tenant, meta.previous_response_id)
                if record is None:
                    raise ResponseNotFound(meta.previous_response_id, "previous_response_id")
                rid = request.headers.get("x-request-id")
                meta, specs = parse(body, tenant, rid, record["messages"])
            if meta.store and not await store.has_room(tenant):  # (its budget: answered, not kept)
                meta = replace(meta, store=False, echoed={**meta.echoed, "store": False})
            return meta, specs

        try:
            meta, specs, token_lists, tenant = await self._prepare(
                request, parse, RESPONSES_FIELDS, with_store
            )
        except Exception as exc:
            return self.s.error(exc, {"messages": "input"})
        headers = {"x-request-id": request.headers.get("x-request-id") or meta.response_id}
        shaper = ResponsesShaper(
            meta, store, tenant, self.s.tokenizer, self.s.intake.reasoning, token_lists[0]
        )
        return await Generation(self.s.intake, shaper, specs, token_lists).answer(request, headers)

    async def kept_response(self, request: Request) -> Response:
        """``GET`` (the response) or ``DELETE`` ``/v1/responses/{response_id}``, the
        caller's tenant's only."""
        try:
            tenant = self.s.tenant(request)
            rid = request.path_params["response_id"]
            store = self.s.responses_store
            if store is None:
                raise ResponseNotFound(rid)
            if request.method == "DELETE":
                if not await store.delete(tenant, rid):
                    raise ResponseNotFound(rid)
                return JSONResponse({"id": rid, "object": "response", "deleted": True})
            record = await store.get(tenant, rid)
            if record is None:
                raise ResponseNotFound(rid)
            return JSONResponse(record["response"])
        except Exception as exc:
            return self.s.error(exc)

    async def _prepare(
        self,
        request: Request,
        parse: Callable[[Any, str | None, str | None], tuple[Any, list[GenerateSpec]]],
        known: frozenset[str],
        amend: Callable[..., Awaitable[tuple[Any, list[GenerateSpec]]]] | None = None,
    ) -> tuple[Any, list[GenerateSpec], list[list[int]], str | None]:
        """``parse(body, tenant, header request id)``: the API's (meta, specs);
        ``amend(body, tenant, meta, specs)``: them with what the API adds after parsing (a
        kept conversation). Returns them, their prompts' ids and the tenant."""
        await self.s.intake.turn()  # a burst's parsing spread over loop iterations
        tenant = self.s.tenant(request)  # first: an unauthenticated caller learns nothing
        try:  # then the cheap refusal, before any parsing
            self.s.core.check_room()
        except ClusterOverloaded:
            async with read_body(request, self.s.body_limits()):  # drained unparsed: the
                pass  # connection stays usable
            raise
        header_rid = request.headers.get("x-request-id")
        body, meta, specs = await self.s.json_body(
            request, lambda body: (body, *parse(body, tenant, header_rid))
        )
        self._note_unknown(body, known)
        if amend is not None:
            meta, specs = await amend(body, tenant, meta, specs)
        lora = await self.s.intake.lora_of(meta.model or None, tenant)
        if not meta.model:
            meta = replace(meta, model=self.s.intake.model_id)
        if lora is not None:
            specs = [replace(s, params=replace(s.params, lora=lora)) for s in specs]
        token_lists = [await self.s.intake.token_ids(s) for s in specs]
        return meta, specs, token_lists, tenant

    async def _generate(self, request: Request, chat: bool) -> Response:
        def parse(body: Any, tenant: str | None, rid: str | None) -> tuple[Any, list[Any]]:
            return parse_request(
                body,
                chat=chat,
                tenant=tenant,
                limits=self.s.limits,
                now=int(time.time()),
                header_request_id=rid,
            )

        try:
            meta, specs, token_lists, _ = await self._prepare(request, parse, known_fields(chat))
        except Exception as exc:
            return self.s.error(exc, {"text": "prompt", "token_ids": "prompt"})
        echoes = None
        if meta.echo:  # the prompt as the client sent it (token ids: their text)
            echoes = [
                s.text if s.text is not None else self.s.tokenizer.decode(ids)
                for s, ids in zip(specs, token_lists, strict=True)
            ]
        shaper = Shaper(
            meta,
            specs[0].params.n,
            self.s.tokenizer,
            echoes,
            token_lists,
            reasoning=self.s.intake.reasoning,
        )
        # the client's X-Request-Id comes back as it was sent; else the answer's id
        headers = {"x-request-id": request.headers.get("x-request-id") or meta.response_id}
        return await Generation(self.s.intake, shaper, specs, token_lists).answer(request, headers)

    def _note_unknown(self, body: Any, known: frozenset[str]) -> None:
        """Unknown fields are ignored (as vLLM does), logged once per name and counted."""
        if not isinstance(body, dict):
            return
        for name in set(body) - known:
            shown = name.encode("unicode_escape").decode()[:64]
            if self.s.intake.metrics.unknown_field(shown):
                log.warning("ignoring unknown request field %r (logged once per name)", shown)
