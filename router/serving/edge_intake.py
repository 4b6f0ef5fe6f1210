"""The one intake both edges share: auth, limits, tokenizing, models, metrics, and the
generation stream of a validated :class:`GenerateSpec`.

The gRPC servicer and the OpenAI HTTP app are thin parsers: each builds a
:class:`GenerateSpec` with :func:`router.serving.generate_spec.make_spec` and hands it here;
errors map to both protocols in :mod:`router.serving.request_errors`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.outputs import RequestOutput
from kvstore.requests.sampling_params import SamplingParams
from router.placement.adapters import adapter_name, for_tenant
from router.placement.config import RequestLimits
from router.serving.auth import TokenAuth
from router.serving.core import ServingCore
from router.serving.generate_spec import ChatOptions, GenerateSpec
from router.serving.iteration_slices import IterationSlices
from router.serving.request_errors import ModelNotFound, RequestFailed, Unauthenticated, renamed
from router.serving.serving_metrics import ServingMetrics
from router.serving.slo import SloBounds
from router.serving.tokenizing import TokenizerPool, check_chat_chars, check_text_chars
from worker.model.reasoning_markers import ReasoningMarkers
from worker.model.tokenizer import Tokenizer

_PLAIN_CHAT = ChatOptions()
# requests whose intake (validation, limits, placement's hand-off: ~0.3 ms each) runs per loop
# iteration at most: a burst of 256 arriving together otherwise runs all of theirs in one
# iteration (~100 ms in which no stream is written, no probe answered)
INTAKE_SLICE = 16


def chat_token_ids(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], chat: ChatOptions = _PLAIN_CHAT
) -> list[int]:
    """Render a conversation with the model's chat template and tokenize it; a bad message
    or a model without a template is the client's error (naming the messages)."""
    try:
        tools = {"tools": chat.tools} if chat.tools else {}  # (only a chat with tools)
        return tokenizer.encode_chat(
            messages,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            template_kwargs=chat.template_kwargs,
            **tools,
        )
    except (ValueError, TypeError) as exc:
        raise InvalidRequest("messages", f"<{len(messages)} messages>", str(exc)) from exc


class Intake:
    """One router's front door, shared by its gRPC and HTTP edges."""

    def __init__(
        self,
        core: ServingCore,
        tokenizer: Tokenizer,
        *,
        auth: TokenAuth | None,
        limits: RequestLimits,
        tokenize: TokenizerPool | None = None,
        slo: SloBounds | None = None,
        log_stats: bool = True,
        reasoning: ReasoningMarkers | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        # the model's reasoning markers, where its answers are split into reasoning and
        # content (None: a model without them, or engine.reasoning off)
        self.reasoning = reasoning
        self.auth = auth
        self.limits = limits
        self.tokenize = tokenize or TokenizerPool(tokenizer)
        # Grammar compile checks (up to a second for a hostile schema; the library releases
        # the GIL) in a thread of their own: never on the event loop, and a flood of them
        # queues behind itself, not behind (or in front of) tokenizing.
        self._grammars = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
        self.metrics = ServingMetrics(core.limits.model_id, slo=slo, log_stats=log_stats)
        self.started = int(time.time())
        self.turns = IterationSlices(INTAKE_SLICE)

    @property
    def model_id(self) -> str:
        return self.core.limits.model_id

    @property
    def max_model_len(self) -> int:
        return self.core.limits.max_model_len

    def close(self) -> None:
        self.tokenize.close()
        self._grammars.shutdown(wait=False, cancel_futures=True)

    # -- auth and models ------------------------------------------------------------------

    def tenant(self, metadata: Any, claimed: str = "") -> str | None:
        """The caller's tenant: the bearer token's (``metadata``: header or gRPC metadata
        pairs) with auth; without auth the client's own claim (None when it makes none)."""
        if self.auth is None:
            return claimed or None
        tenant = self.auth.tenant_of(metadata)
        if tenant is None:
            raise Unauthenticated(
                "missing or invalid bearer token (header 'Authorization: Bearer ...')"
            )
        if claimed and claimed != tenant:
            raise InvalidRequest("tenant", claimed, "must match the bearer token's tenant")
        return tenant

    async def adapters(self, tenant: str | None) -> list[str]:
        """The adapters live workers serve that ``tenant`` may see (another tenant's are
        neither listed nor served to it)."""
        loads = for_tenant(await self.core.directory.candidates(), tenant)
        return sorted({adapter_name(i) for ld in loads.values() for i in ld.lora_ids})

    async def lora_of(self, model: str | None, tenant: str | None) -> str | None:
        """``model`` is the base model or an adapter a live worker serves to ``tenant``;
        no model is the base model, whatever adapters are served (as vLLM reads it)."""
        if model is None or model == self.model_id:
            return None
        if model in await self.adapters(tenant):
            return model
        shown = model if len(model) <= 64 else f"<{len(model)} chars>"
        raise ModelNotFound(f"model {shown!r} does not exist; GET /v1/models lists the served ones")

    async def turn(self) -> None:
        """Wait for this request's slice of a loop iteration (see :data:`INTAKE_SLICE`): an
        edge calls it once per request, before parsing it (its validation and hand-off then
        run in the same turn: a second entry would halve the slice)."""
        await self.turns.enter()

    # -- tokenizing -----------------------------------------------------------------------

    async def token_ids(self, spec: GenerateSpec) -> list[int]:
        """The prompt's token ids: off the event loop, long texts apart, and a text too
        long for the model refused before it is tokenized. Every edge calls this before
        generating, so the request's grammars are compile-checked here first (off the
        loop too): one the library cannot compile is InvalidRequest naming its field."""
        loop = asyncio.get_running_loop()
        try:
            for grammar in spec.grammars:
                await loop.run_in_executor(self._grammars, grammar.check)
            if spec.messages is not None:
                chars = check_chat_chars(
                    spec.messages, self.limits, self.max_model_len, spec.chat.rendered_chars
                )
                ids = await self.tokenize.run(
                    chars, chat_token_ids, self.tokenizer, spec.messages, spec.chat
                )
            elif spec.token_ids is not None:
                ids = spec.token_ids
            else:
                assert spec.text is not None
                check_text_chars("text", spec.text, self.limits, self.max_model_len)
                ids = await self.tokenize.encode(spec.text)
            if spec.drop_turns and len(ids) > (limit := self._prompt_room(spec)):
                ids = await self._without_oldest_turns(spec, ids, limit)
        except InvalidRequest as exc:
            raise renamed(exc, spec.names) from None
        k = spec.truncate_prompt_tokens
        if k is not None:  # vLLM's: keep the last k (-1: as many as the model takes)
            k = self.core.limits.max_prompt_tokens if k == -1 else k
            ids = ids[-k:]
        return ids

    def _prompt_room(self, spec: GenerateSpec) -> int:
        """The most prompt tokens ``spec`` may keep: the context less its given max_tokens
        (else less one token)."""
        out = spec.params.max_tokens if spec.max_tokens_given else 1
        return max(1, self.max_model_len - out)

    async def _without_oldest_turns(
        self, spec: GenerateSpec, ids: list[int], limit: int
    ) -> list[int]:
        """``spec``'s conversation less its oldest turns, to fit ``limit`` tokens: its
        leading system messages (the instructions) kept, whole turns dropped (a turn starts
        at a user message, so no tool result loses its call), the fewest that fit found by
        a binary search of renders. When even the last turn does not fit, the prompt's last
        ``limit`` tokens."""
        msgs = spec.messages
        assert msgs is not None
        head = 0
        while head < len(msgs) and msgs[head]["role"] in ("system", "developer"):
            head += 1
        cuts = [i for i in range(head + 1, len(msgs)) if msgs[i]["role"] == "user"]
        best: list[int] | None = None
        lo, hi = 0, len(cuts) - 1
        while lo <= hi:  # the first cut whose render fits (later cuts keep fewer tokens)
            mid = (lo + hi) // 2
            kept = (*msgs[:head], *msgs[cuts[mid] :])
            # (a part of a conversation already checked: counted, never refused)
            chars = check_chat_chars(
                kept, self.limits, self.max_model_len, spec.chat.rendered_chars
            )
            got = await self.tokenize.run(chars, chat_token_ids, self.tokenizer, kept, spec.chat)
            if len(got) <= limit:
                best, hi = got, mid - 1
            else:
                lo = mid + 1
        return best if best is not None else ids[-limit:]

    def fitted(self, spec: GenerateSpec, ids: list[int]) -> SamplingParams:
        """The request's parameters with an unset ``max_tokens`` fitted to what the prompt
        leaves of the context: the default (16) cut to it, or all of it where the request
        asks for that (OpenAI's chat). A given one is left as sent: the limits' check
        refuses it when it does not fit."""
        room = self.max_model_len - len(ids)
        params = spec.params
        if spec.max_tokens_given or room < 1:  # (no room: the prompt is refused)
            return params
        max_tokens = room if spec.fill_context else min(params.max_tokens, room)
        if max_tokens == params.max_tokens:
            return params
        try:
            return replace(params, max_tokens=max_tokens)
        except InvalidRequest as exc:  # min_tokens over what the context leaves
            raise renamed(exc, spec.names) from None

    # -- generation -----------------------------------------------------------------------

    async def generate(
        self, spec: GenerateSpec, ids: list[int]
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        """The request's ``(worker, output)`` stream (see ``ServingCore.generate``); an error
        inside the engine ends it with :class:`RequestFailed`, and an over-limit request
        with its field named as the client's API spells it."""
        timer = self.metrics.tracker()
        try:
            gen = self.core.generate(
                spec.request_id,
                ids,
                self.fitted(spec, ids),
                tenant=spec.tenant or None,
                continue_from=spec.continue_from,
            )
            async for worker, out in gen:
                if out.error is not None:  # it failed inside the engine (the engine goes on)
                    raise RequestFailed(
                        f"request {out.request_id!r} failed on {worker}: {out.error}"
                    )
                timer.output(worker, out)
                yield worker, out
        except InvalidRequest as exc:
            raise renamed(exc, spec.names) from None
