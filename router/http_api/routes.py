"""The HTTP edge's routes besides generation, in vLLM's shapes: models, tokenize and
detokenize (text or chat messages), Prometheus metrics, version, health.

``/metrics``, ``/health`` and ``/version`` are open (probes and scrapers carry no token);
the others need the bearer token when auth is on. The cheap ones (models, health, version,
metrics) pass the server's :class:`~router.http_api.probe_gate.ProbeGate` first, and their fleet
reads are shared through an :class:`~router.serving.answer_cache.AnswerCache`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from kvstore.requests.errors import InvalidRequest
from router.http_api import tools
from router.http_api.fields import chat_options, get_bool, get_str, messages, token_ids
from router.http_api.probe_gate import ANSWER_TTL_S
from router.placement.placement_types import NoWorkersError
from router.serving.answer_cache import AnswerCache
from router.serving.generate_spec import make_spec
from router.serving.request_errors import ModelNotFound
from router.serving.serving_metrics import CONTENT_TYPE
from router.serving.tokenizing import check_text_chars

if TYPE_CHECKING:
    from router.http_api.app import OpenAIServer

_TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "return_token_strs",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    }
)


def _version() -> str:
    try:
        return version("kvcluster")
    except PackageNotFoundError:  # run from a source tree without installing
        return "0.0.0+source"


def routes(server: OpenAIServer) -> list[BaseRoute]:
    h = server.handlers
    return [
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", h.model, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/version", h.version, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
    ]


def probe_routes(server: OpenAIServer) -> dict[str, Any]:
    """The cheap routes by exact path (``/v1/models/{id}`` is routed, then gated)."""
    h = server.handlers
    return {
        "/v1/models": h.models,
        "/metrics": h.metrics,
        "/version": h.version,
        "/health": h.health,
    }


class Handlers:
    def __init__(self, server: OpenAIServer) -> None:
        self.s = server
        self.intake = server.intake
        self.answers = AnswerCache(ANSWER_TTL_S)
        self._version = JSONResponse({"version": _version()}).body  # read once: it is a file

    async def _cards(self, tenant: str | None) -> list[dict[str, Any]]:
        """vLLM's model cards: the base model, then every adapter a live worker serves to
        ``tenant`` (shared for :data:`~router.http_api.probe_gate.ANSWER_TTL_S`)."""
        return await self.answers.get(("cards", tenant), lambda: self._read_cards(tenant))

    async def _read_cards(self, tenant: str | None) -> list[dict[str, Any]]:
        base, created = self.intake.model_id, self.intake.started
        card = {"object": "model", "created": created, "owned_by": "kvcluster"}
        cards = [
            {
                "id": base,
                **card,
                "root": base,
                "parent": None,
                "max_model_len": self.intake.max_model_len,
            }
        ]
        cards += [
            {"id": a, **card, "root": a, "parent": base} for a in await self.intake.adapters(tenant)
        ]
        return cards

    async def models(self, request: Request) -> Response:
        try:
            cards = await self._cards(self.s.tenant(request))
            return JSONResponse({"object": "list", "data": cards})
        except Exception as exc:
            return self.s.error(exc)

    async def model(self, request: Request) -> Response:
        try:
            tenant = self.s.tenant(request)
            wanted = request.path_params["model_id"]
            for card in await self._cards(tenant):
                if card["id"] == wanted:
                    return JSONResponse(card)
            shown = wanted if len(wanted) <= 64 else f"<{len(wanted)} chars>"
            raise ModelNotFound(f"model {shown!r} does not exist; GET /v1/models lists them")
        except Exception as exc:
            return self.s.error(exc)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: ``prompt`` (text) or ``messages`` (rendered with the chat
        template) -> ``{count, max_model_len, tokens, token_strs}``."""
        try:
            tenant, body = await self._tokens_body(request)
            self._note(body)
            chat = body.get("messages") is not None
            add_special = get_bool(body, "add_special_tokens")
            if chat:
                msgs = messages(body)
                opts = tools.chat_options(chat_options(body), None, msgs)  # with its size
                spec = make_spec(
                    messages=msgs,
                    chat=opts,
                    request_id="",
                    tenant=tenant,
                    values={},
                    limits=self.s.limits,
                )
                ids = await self.intake.token_ids(spec)
                if add_special:  # the template emits the special tokens; as vLLM does
                    ids = self.s.tokenizer.encode("", True)[:1] + ids
            else:
                text = get_str(body, "prompt")
                if text is None:
                    raise InvalidRequest("prompt", None, "is required (or messages)")
                limits, mml = self.s.limits, self.intake.max_model_len
                check_text_chars("prompt", text, limits, mml)
                ids = await self.intake.tokenize.encode(text, add_special is not False)
            strs = None
            if get_bool(body, "return_token_strs"):
                strs = [self.s.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
            return JSONResponse(
                {
                    "count": len(ids),
                    "max_model_len": self.intake.max_model_len,
                    "tokens": ids,
                    "token_strs": strs,
                }
            )
        except Exception as exc:
            return self.s.error(exc, {"text": "prompt"})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: ``tokens`` -> ``{prompt}``."""
        try:
            tenant, body = await self._tokens_body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise InvalidRequest("tokens", "<missing>", "must be a list of token ids")
            ids = token_ids("tokens", tokens)
            if len(ids) > self.intake.max_model_len:
                raise InvalidRequest(
                    "tokens", len(ids), f"must be at most {self.intake.max_model_len} ids"
                )
            vocab = self.s.core.limits.vocab_size
            if ids and max(ids) >= vocab:
                raise InvalidRequest("tokens", max(ids), f"must be < vocab_size={vocab}")
            text = await self.intake.tokenize.run(len(ids), self.s.tokenizer.decode, ids)
            return JSONResponse({"prompt": text})
        except Exception as exc:
            return self.s.error(exc)

    async def _tokens_body(self, request: Request) -> tuple[str, dict]:
        """The tenant and JSON object of a /tokenize or /detokenize call, its ``model``
        checked (a model the tenant may not see is not found)."""
        tenant = self.s.tenant(request)
        body = await self.s.json_body(request)
        if not isinstance(body, dict):
            raise InvalidRequest("body", type(body).__name__, "must be a JSON object")
        await self.intake.lora_of(get_str(body, "model") or None, tenant)
        return tenant, body

    def _note(self, body: dict) -> None:
        for name in set(body) - _TOKENIZE_FIELDS:
            self.intake.metrics.unknown_field(name.encode("unicode_escape").decode()[:64])

    async def metrics(self, request: Request) -> Response:
        core = self.s.core
        statuses = await core.directory.statuses()
        routing = {**core.router.metrics.snapshot(), "retries": core.retries}
        routing["broken_streams"] = core.broken
        routing["migrations"] = dict(core.migrations)
        return Response(self.intake.metrics.render(statuses, routing), media_type=CONTENT_TYPE)

    async def version(self, request: Request) -> Response:
        return Response(self._version, media_type="application/json")

    async def health(self, request: Request) -> Response:
        live = await self.answers.get("live", self._live_workers)
        if not live:
            return self.s.error(NoWorkersError("no live worker"))
        return JSONResponse({"status": "ok", "live_workers": live})

    async def _live_workers(self) -> int:
        return len(await self.s.core.directory.candidates())
