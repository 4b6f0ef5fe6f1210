"""The HTTP edge's generation routes, ``POST /v1/completions`` and
``POST /v1/chat/completions``: a request parsed and tokenized through the router's
:class:`~router.serving.edge_intake.Intake`, answered by a
:class:`~router.http_api.generation.Generation` (SSE when ``stream``). The server calls
them straight, past Starlette's routing (:class:`~router.http_api.app.OpenAIServer`)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from router.http_api.body import read_body
from router.http_api.generation import Generation
from router.http_api.openai_request import OpenAIRequest, known_fields, parse_request
from router.http_api.responses import Shaper
from router.serving.core import ClusterOverloaded
from router.serving.generate_spec import GenerateSpec

if TYPE_CHECKING:
    from router.http_api.app import OpenAIServer

log = logging.getLogger("router.http_api.app")  # the server's log, as its other lines


class GenerationRoutes:
    """The two generation routes of one server."""

    def __init__(self, server: OpenAIServer) -> None:
        self.s = server

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _prepare(
        self, request: Request, chat: bool
    ) -> tuple[OpenAIRequest, list[GenerateSpec], list[list[int]]]:
        await self.s.intake.turn()  # a burst's parsing spread over loop iterations
        tenant = self.s.tenant(request)  # first: an unauthenticated caller learns nothing
        try:  # then the cheap refusal, before any parsing
            self.s.core.check_room()
        except ClusterOverloaded:
            async with read_body(request, self.s.body_limits()):  # drained unparsed: the
                pass  # connection stays usable
            raise
        header_rid = request.headers.get("x-request-id")

        def parse(body: Any) -> tuple[Any, OpenAIRequest, list[GenerateSpec]]:
            meta, specs = parse_request(
                body,
                chat=chat,
                tenant=tenant,
                limits=self.s.limits,
                now=int(time.time()),
                header_request_id=header_rid,
            )
            return body, meta, specs

        body, meta, specs = await self.s.json_body(request, parse)
        self._note_unknown(body, chat)
        lora = await self.s.intake.lora_of(meta.model or None, tenant)
        if not meta.model:
            meta = replace(meta, model=self.s.intake.model_id)
        if lora is not None:
            specs = [replace(s, params=replace(s.params, lora=lora)) for s in specs]
        token_lists = [await self.s.intake.token_ids(s) for s in specs]
        return meta, specs, token_lists

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            meta, specs, token_lists = await self._prepare(request, chat)
        except Exception as exc:
            return self.s.error(exc, {"text": "prompt", "token_ids": "prompt"})
        echoes = None
        if meta.echo:  # the prompt as the client sent it (token ids: their text)
            echoes = [
                s.text if s.text is not None else self.s.tokenizer.decode(ids)
                for s, ids in zip(specs, token_lists, strict=True)
            ]
        shaper = Shaper(meta, specs[0].params.n, self.s.tokenizer, echoes, token_lists)
        # the client's X-Request-Id comes back as it was sent; else the answer's id
        headers = {"x-request-id": request.headers.get("x-request-id") or meta.response_id}
        return await Generation(self.s.intake, shaper, specs, token_lists).answer(request, headers)

    def _note_unknown(self, body: Any, chat: bool) -> None:
        """Unknown fields are ignored (as vLLM does), logged once per name and counted."""
        if not isinstance(body, dict):
            return
        for name in set(body) - known_fields(chat):
            shown = name.encode("unicode_escape").decode()[:64]
            if self.s.intake.metrics.unknown_field(shown):
                log.warning("ignoring unknown request field %r (logged once per name)", shown)
