"""Engine outputs -> OpenAI Responses API objects: the whole ``response``, or its stream of
typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``), each with its ``sequence_number``, as the ``openai`` client's
``responses.stream`` assembles them.

The answer is one assistant message (its text as one ``output_text`` part), after a
``reasoning`` item when a reasoning model reasoned (its text as one ``reasoning_text``
part, ``router/serving/reasoning_split.py``) and, with tools, one ``function_call`` item per
call the answer makes (parsed as for chat: ``tool_calls.py``; while streaming, text that may be a
call is held back until the answer ends). An answer cut by ``max_output_tokens`` (or the
context) is ``incomplete``. A response the request keeps goes to the response store before
its last event (or the whole answer) is sent, so a client that continues it at once finds it.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvstore.requests.outputs import Completion, CompletionDelta, TokenLogprob, Usage
from router.http_api.response_store import ResponseStore
from router.http_api.responses import token_logprobs_json
from router.http_api.responses import usage_json as completion_usage_json
from router.http_api.responses_request import ResponsesRequest
from router.http_api.sse import typed_event
from router.http_api.tool_calls import ToolStream, parse_calls
from router.serving.reasoning_split import ReasoningSplit
from worker.model.reasoning_markers import ReasoningMarkers
from worker.model.tokenizer import Tokenizer


def usage_json(usages: list[Usage], reasoning_tokens: int = 0) -> dict[str, Any] | None:
    """The completions' usage under the Responses API's names."""
    if not usages:
        return None
    u = completion_usage_json(usages)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": u["prompt_tokens_details"],
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u["total_tokens"],
    }


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if status == "completed" else "",
        "status": status,
    }


class ResponsesShaper:
    """One /v1/responses answer (one prompt, one sample)."""

    n = 1  # samples per prompt (the API has no n)

    def __init__(
        self,
        req: ResponsesRequest,
        store: ResponseStore | None = None,
        tenant: str | None = None,
        tokenizer: Tokenizer | None = None,
        reasoning: ReasoningMarkers | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """``tokenizer``: the tokens' texts of the answer's logprobs (when it has them);
        ``reasoning``: a reasoning model's markers, with ``prompt_ids`` the prompt's tokens
        (where its output begins)."""
        self.req = req
        self._split = (
            ReasoningSplit(reasoning, reasoning.prompt_state(prompt_ids or []))
            if reasoning is not None
            else None
        )
        self._reasoning_id = "rs_" + uuid.uuid4().hex
        self._thought = ""  # the reasoning's text sent so far
        self._thinking = False  # the reasoning item was announced and is not done
        self.tokenizer = tokenizer
        self._lps: list[TokenLogprob] = []  # the answer's token logprobs so far
        self._lps_json: list[dict[str, Any]] = []  # all of them as the answer shows them
        self.stream = req.stream
        self.store = store if req.store else None
        self.tenant = tenant
        self._final: dict[str, Any] | None = None  # the response, once it ended
        self._answer: dict[str, Any] = {}  # its answer as the conversation's assistant turn
        self._message_id = "msg_" + uuid.uuid4().hex
        self._seq = 0  # the next event's sequence_number
        self._text = ""  # the message's text sent so far
        self._open = False  # the message item and its text part were announced
        self._tools = ToolStream(req.tools) if req.tools is not None else None
        self._calls: list[dict[str, Any]] = []
        self._reason: str | None = None  # the answer's finish reason, once it ended

    # -- the response object --------------------------------------------------------------

    def _response(
        self, status: str, output: list[dict[str, Any]], usages: list[Usage] | None = None
    ) -> dict[str, Any]:
        reasoning_tokens = self._split.reasoning_tokens if self._split is not None else 0
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.req.response_id,
            "object": "response",
            "created_at": self.req.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.req.model,
            "output": output,
            "reasoning": None,
            "usage": usage_json(usages or [], reasoning_tokens),
            **self.req.echoed,
        }

    @staticmethod
    def _status(reason: str | None) -> str:
        return "incomplete" if reason == "length" else "completed"

    def _logprobs(self, lps: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        k = self.req.top_logprobs
        if k is None or not lps or self.tokenizer is None:
            return []
        tok = self.tokenizer
        return token_logprobs_json(lps, k, lambda t: tok.decode([t], skip_special_tokens=False))

    def _message(
        self, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self._message_id,
            "status": status,
            "role": "assistant",
            "content": [_text_part(text, logprobs)],
        }

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self._reasoning_id,
            "summary": [],
            "content": [_reasoning_part(text)] if status != "in_progress" else [],
            "status": status,
        }

    @property
    def _message_index(self) -> int:
        return 1 if self._thought else 0

    def _output(self, content: str | None, calls: list[dict[str, Any]], status: str) -> list:
        """The reasoning (when there was one), the message (when it has text, or nothing
        else is answered), then the calls."""
        message = self._message(content or "", status, self._lps_json)
        items = [self._reasoning_item(self._thought, "completed")] if self._thought else []
        items += [message] if content or not calls else []
        return items + [_call_item(c) for c in calls]

    def whole(
        self,
        completions: list[tuple[int, Completion]],
        usages: list[Usage],
        prompts: dict[int, list[TokenLogprob | None] | None] | None = None,
    ) -> dict[str, Any]:
        (_, c), *_ = completions
        self._lps_json = self._logprobs(c.logprobs)
        reason = c.finish_reason.value if c.finish_reason else None
        content, calls = c.text, []
        if self._split is not None:
            self._thought, content = self._split.split(c.text, c.token_ids)
        if self.req.tools is not None:
            content, calls = parse_calls(content, self.req.tools)
        return self._ended(content, calls, self._status(reason), usages)

    def _ended(
        self, content: str | None, calls: list[dict[str, Any]], status: str, usages: list[Usage]
    ) -> dict[str, Any]:
        self._answer = {"role": "assistant", "content": content or ""}
        if self._thought:  # (a reasoning model's template decides whether it shows it again)
            self._answer["reasoning_content"] = self._thought
        if calls:
            self._answer["tool_calls"] = calls
        self._final = self._response(status, self._output(content, calls, status), usages)
        return self._final

    async def settle(self) -> None:
        """Keep the response that ended (when the request keeps it)."""
        if self.store is not None and self._final is not None:
            conversation = [*self.req.conversation, self._answer]
            await self.store.put(self.tenant, self._final, conversation)

    # -- the stream -----------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return typed_event(kind, body)

    def _where(self) -> dict[str, Any]:
        return {
            "item_id": self._message_id,
            "output_index": self._message_index,
            "content_index": 0,
        }

    def _announce(self) -> bytes:
        """The message item and its text part, before its first text."""
        self._open = True
        return self._event(
            "response.output_item.added",
            output_index=self._message_index,
            item={**self._message("", "in_progress"), "content": []},
        ) + self._event(
            "response.content_part.added",
            item_id=self._message_id,
            output_index=self._message_index,
            content_index=0,
            part=_text_part(""),
        )

    def _reasoning_where(self) -> dict[str, Any]:
        return {"item_id": self._reasoning_id, "output_index": 0, "content_index": 0}

    def _reasoning_events(self, thought: str) -> bytes:
        """The reasoning's new text (the item announced before its first)."""
        out = b""
        if not self._thinking:
            self._thinking = True
            out = self._event(
                "response.output_item.added",
                output_index=0,
                item=self._reasoning_item("", "in_progress"),
            ) + self._event(
                "response.content_part.added",
                item_id=self._reasoning_id,
                output_index=0,
                content_index=0,
                part=_reasoning_part(""),
            )
        self._thought += thought
        return out + self._event(
            "response.reasoning_text.delta", **self._reasoning_where(), delta=thought
        )

    def _reasoning_done(self) -> bytes:
        """The reasoning ended (its answer begins, or the answer ended)."""
        if not self._thinking:
            return b""
        self._thinking = False
        where = self._reasoning_where()
        part = _reasoning_part(self._thought)
        return (
            self._event("response.reasoning_text.done", **where, text=self._thought)
            + self._event("response.content_part.done", **where, part=part)
            + self._event(
                "response.output_item.done",
                output_index=0,
                item=self._reasoning_item(self._thought, "completed"),
            )
        )

    def opening(self) -> bytes:
        snapshot = self._response("in_progress", [])
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def event(
        self,
        prompt_idx: int,
        d: CompletionDelta,
        first: bool,
        usage: Usage | None = None,
        prompt: list[TokenLogprob | None] | None = None,
    ) -> bytes:
        self._lps += d.logprobs or []
        text, out = d.text, b""
        if self._split is not None:
            thought, text = self._split.feed(d.text, d.token_ids, d.finish_reason is not None)
            if thought:
                out = self._reasoning_events(thought)
        text = text if self._tools is None else self._tools.feed(text)
        if d.finish_reason is not None:
            self._reason = d.finish_reason.value
            if self._tools is not None:
                rest, self._calls = self._tools.finish()
                text += rest
        if not text:
            return out
        out += self._reasoning_done()
        out += b"" if self._open else self._announce()
        self._text += text
        # (with tools, text held back has its logprobs in the done events only)
        lps = self._logprobs(d.logprobs) if self._tools is None else []
        return out + self._event(
            "response.output_text.delta", **self._where(), delta=text, logprobs=lps
        )

    def closing(self, usages: list[Usage]) -> bytes:
        status = self._status(self._reason)
        self._lps_json = self._logprobs(self._lps)
        out = [self._reasoning_done()]
        if self._text or not self._calls:  # the message, closed (opened if it had no text)
            if not self._open:
                out.append(self._announce())
            where, lps = self._where(), self._lps_json
            out += [
                self._event("response.output_text.done", **where, text=self._text, logprobs=lps),
                self._event(
                    "response.content_part.done", **where, part=_text_part(self._text, lps)
                ),
                self._event(
                    "response.output_item.done",
                    output_index=self._message_index,
                    item=self._message(self._text, status, lps),
                ),
            ]
        first = self._message_index + (1 if self._text or not self._calls else 0)
        for k, call in enumerate(self._calls, start=first):
            item = _call_item(call)
            out += [
                self._event(
                    "response.output_item.added",
                    output_index=k,
                    item=_call_item(call, "in_progress"),
                ),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=k,
                    delta=item["arguments"],
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=k,
                    name=item["name"],
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=k, item=item),
            ]
        whole = self._ended(self._text, self._calls, status, usages)
        out.append(self._event(f"response.{status}", response=whole))
        return b"".join(out)

    def failed(self, error: dict[str, Any]) -> bytes:
        """An error after the stream began (the worker died, the engine failed it)."""
        err = error["error"]
        snapshot = self._response("failed", [])
        snapshot["error"] = {"code": err["code"] or err["type"], "message": err["message"]}
        return self._event(
            "error", code=err["code"], message=err["message"], param=err["param"]
        ) + self._event("response.failed", response=snapshot)
