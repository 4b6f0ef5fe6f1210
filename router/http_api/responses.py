"""Engine outputs -> OpenAI response objects (whole responses and stream chunks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvstore.requests.outputs import Completion, CompletionDelta, TokenLogprob, Usage
from router.http_api.openai_request import OpenAIRequest
from router.http_api.sse import DONE, PlainChunks, sse_event
from router.http_api.tool_calls import ToolStream, message_json, tool_chunk_delta
from router.serving.reasoning_split import ReasoningSplit
from worker.model.reasoning_markers import ReasoningMarkers
from worker.model.tokenizer import Tokenizer


def usage_json(usages: list[Usage], reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Summed over a batch's prompts; ``cached_tokens``: prompt tokens served from KV cache;
    ``reasoning_tokens``: of the completion tokens, the reasoning's (a reasoning model's)."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def token_logprobs_json(
    lps: Iterable[TokenLogprob], k: int, piece: Callable[[int], str]
) -> list[dict[str, Any]]:
    """OpenAI's chat (and Responses) form: per token its text, logprob and bytes, and the k
    most likely alternatives, the sampled token among them or not."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = piece(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return [
        {**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top[:k]]}
        for x in lps
    ]


class Shaper:
    """Builds one request's response objects; choice index = prompt index * n + sample.
    ``echoes``: per prompt, the text put before its completions (``echo``);
    ``prompt_ids``: per prompt, its token ids (for its tokens' logprobs); ``reasoning``: a
    reasoning model's markers (a chat's answers are split into reasoning and content)."""

    def __init__(
        self,
        req: OpenAIRequest,
        n: int,
        tokenizer: Tokenizer,
        echoes: list[str] | None = None,
        prompt_ids: list[list[int]] | None = None,
        reasoning: ReasoningMarkers | None = None,
    ) -> None:
        self.req = req
        self.n = n
        self.tok = tokenizer
        self.kind = "chat.completion" if req.chat else "text_completion"
        self.echoes = echoes or []
        self.prompt_ids = prompt_ids or []
        self._offsets: dict[int, int] = {}  # choice -> characters of text before its next token
        self._tool_streams: dict[int, ToolStream] = {}  # chat with tools: per choice
        self.reasoning = reasoning if req.chat else None
        self._splits: dict[int, ReasoningSplit] = {}  # a reasoning model's chat: per choice
        # the events that differ only in their text, index and finish reason: pre-encoded
        plain = (
            req.top_logprobs is None
            and req.tools is None
            and not req.continuous_usage
            and not req.return_token_ids
            and self.reasoning is None
        )
        self._plain = (
            PlainChunks(self._head(True), chat=req.chat, usage_null=req.include_usage)
            if plain
            else None
        )

    @property
    def stream(self) -> bool:
        return self.req.stream

    def opening(self) -> bytes:
        return b""

    def _split(self, choice: int) -> ReasoningSplit:
        split = self._splits.get(choice)
        if split is None:
            assert self.reasoning is not None
            state = self.reasoning.prompt_state(self.prompt_ids[choice // self.n])
            split = self._splits[choice] = ReasoningSplit(self.reasoning, state)
        return split

    def _reasoning_tokens(self) -> int | None:
        """The answer's reasoning tokens so far (None: not a reasoning model's chat)."""
        if self.reasoning is None:
            return None
        return sum(s.reasoning_tokens for s in self._splits.values())

    def _chat_delta(
        self, index: int, d: CompletionDelta, reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A chat chunk's ``delta`` (its reasoning apart, its content, its tool calls) and
        finish reason."""
        text, delta = d.text, {}
        if self.reasoning is not None:
            thought, text = self._split(index).feed(d.text, d.token_ids, reason is not None)
            if thought and self.req.include_reasoning:
                delta = {"reasoning": thought, "reasoning_content": thought}
        if self.req.tools is not None:
            stream = self._tool_streams.setdefault(index, ToolStream(self.req.tools))
            calls, reason = tool_chunk_delta(stream, text, reason)
            return {**delta, **calls}, reason
        if text or not delta:
            delta["content"] = text
        return delta, reason

    def _message(self, index: int, c: Completion) -> tuple[dict[str, Any], str | None]:
        """A whole chat answer's message (its reasoning apart, its tool calls) and the
        finish reason its tool calls force."""
        if self.reasoning is None:
            return message_json(c.text, self.req.tools)
        thought, text = self._split(index).split(c.text, c.token_ids)
        msg, reason = message_json(text, self.req.tools)
        shown = (thought or None) if self.req.include_reasoning else None
        return {**msg, "reasoning": shown, "reasoning_content": shown}, reason

    def closing(self, usages: list[Usage]) -> bytes:
        """The stream's end: the usage chunk (include_usage), then ``[DONE]``."""
        return (sse_event(self.usage_chunk(usages)) if self.req.include_usage else b"") + DONE

    def failed(self, error: dict[str, Any]) -> bytes:
        """An error after the stream began: its body as an event, then ``[DONE]``."""
        return sse_event(error) + DONE

    async def settle(self) -> None:
        """(Nothing is kept of a completion.)"""

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = self.kind + (".chunk" if chunk and self.req.chat else "")
        return {
            "id": self.req.response_id,
            "object": obj,
            "created": self.req.created,
            "model": self.req.model,
        }

    def _piece(self, token_id: int) -> str:
        if self.req.token_ids_as_text:  # vLLM's return_tokens_as_token_ids
            return f"token_id:{token_id}"
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _top(self, x: TokenLogprob, k: int) -> dict[str, float]:
        """The k most likely and the token itself (k + 1 entries when it is not among
        them), as OpenAI's and vLLM's completions answer."""
        top = {self._piece(t): v for t, v in x.top[:k]}
        top.setdefault(self._piece(x.token_id), x.logprob)
        return top

    def logprobs_json(
        self,
        lps: list[TokenLogprob] | None,
        choice: int,
        prompt: list[TokenLogprob | None] | None = None,
    ) -> dict[str, Any] | None:
        """``prompt``: with echo, the prompt's token logprobs, put before the completion's
        (the first prompt token has none: null)."""
        k = self.req.top_logprobs
        if k is None or lps is None:
            return None
        if self.req.chat:  # OpenAI: the k most likely, the sampled token or not
            return {"content": token_logprobs_json(lps, k, self._piece)}
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []

        def add(pairs: Iterable[tuple[int, TokenLogprob | None]], at: int) -> int:
            """Append the tokens' columns, the first at text offset ``at``; the offset after."""
            for t, x in pairs:
                piece = self._piece(t)
                tokens.append(piece)
                values.append(None if x is None else x.logprob)
                tops.append(None if x is None else self._top(x, k))
                offsets.append(at)
                at += len(piece)
            return at

        if prompt is not None and self.req.echo:
            add(zip(self.prompt_ids[choice // self.n], prompt, strict=True), 0)
        at = self._offsets.get(choice, len(self._echo(choice)))
        self._offsets[choice] = add(((x.token_id, x) for x in lps), at)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def prompt_logprobs_json(
        self, prompt: list[TokenLogprob | None] | None
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token, token id -> logprob, rank (1 = the
        most likely; null when the token is not among the alternatives) and text."""
        if self.req.prompt_logprobs is None or prompt is None:
            return None
        k = self.req.prompt_logprobs
        out: list[dict[str, Any] | None] = []
        for x in prompt:
            if x is None:
                out.append(None)
                continue
            top = list(x.top[:k])
            ranks = {t: r for r, (t, _) in enumerate(x.top, start=1)}
            entries = {
                str(t): {"logprob": v, "rank": ranks.get(t), "decoded_token": self._piece(t)}
                for t, v in [(x.token_id, x.logprob), *top]
            }
            out.append(entries)
        return out

    def _choice(self, prompt_idx: int, out: CompletionDelta | Completion) -> tuple[int, str | None]:
        """A sample's choice index over the request's prompts, and its finish reason's name."""
        return (
            prompt_idx * self.n + out.index,
            out.finish_reason.value if out.finish_reason else None,
        )

    def _prompt_ids(self, choice: int) -> list[int]:
        """The token ids of ``choice``'s prompt (vLLM's ``prompt_token_ids``)."""
        return list(self.prompt_ids[choice // self.n])

    def _echo(self, choice: int) -> str:
        if not self.req.echo:
            return ""
        return self.echoes[choice // self.n]

    def chunk(
        self,
        prompt_idx: int,
        d: CompletionDelta,
        first: bool,
        usage: Usage | None = None,
        prompt: list[TokenLogprob | None] | None = None,
    ) -> dict[str, Any]:
        """One stream event for one sample's new output (``usage``: the prompt's so far,
        with continuous_usage_stats; ``prompt``: its prompt logprobs, on its first event)."""
        index, reason = self._choice(prompt_idx, d)
        lp = self.logprobs_json(d.logprobs, index, prompt if first else None)
        if self.req.chat:
            delta, reason = self._chat_delta(index, d, reason)
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            text = (self._echo(index) if first else "") + d.text
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        if first and (plp := self.prompt_logprobs_json(prompt)) is not None:
            choice["prompt_logprobs"] = plp
        out = {**self._head(True), "choices": [choice]}
        if self.req.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
            if first:  # the prompt's ids: on the choice (completions) or the chunk (chat)
                (out if self.req.chat else choice)["prompt_token_ids"] = self._prompt_ids(index)
        if self.req.continuous_usage and usage is not None:
            out["usage"] = usage_json([usage], self._reasoning_tokens())
        elif self.req.include_usage:
            out["usage"] = None
        return out

    def event(
        self,
        prompt_idx: int,
        d: CompletionDelta,
        first: bool,
        usage: Usage | None = None,
        prompt: list[TokenLogprob | None] | None = None,
    ) -> bytes:
        """:meth:`chunk` as a server-sent event (a plain one from its pre-encoded parts)."""
        if self._plain is not None and not first:
            index, reason = self._choice(prompt_idx, d)
            return self._plain.event(index, d.text, reason)
        return sse_event(self.chunk(prompt_idx, d, first, usage, prompt))

    def usage_chunk(self, usages: list[Usage]) -> dict[str, Any]:
        usage = usage_json(usages, self._reasoning_tokens())
        return {**self._head(True), "choices": [], "usage": usage}

    def whole(
        self,
        completions: list[tuple[int, Completion]],
        usages: list[Usage],
        prompts: dict[int, list[TokenLogprob | None] | None] | None = None,
    ) -> dict[str, Any]:
        """``prompts``: per prompt index, its prompt logprobs (when asked for)."""
        prompts = prompts or {}
        choices = []
        for prompt_idx, c in completions:
            index, reason = self._choice(prompt_idx, c)
            prompt = prompts.get(prompt_idx)
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": self.logprobs_json(c.logprobs, index, prompt),
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
            if self.req.chat:
                choice["message"], tool_reason = self._message(index, c)
                choice["finish_reason"] = tool_reason or reason
            else:
                choice["text"] = self._echo(index) + c.text
            if (plp := self.prompt_logprobs_json(prompt)) is not None:
                choice["prompt_logprobs"] = plp
            if self.req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                if not self.req.chat:
                    choice["prompt_token_ids"] = self._prompt_ids(index)
            choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        usage = usage_json(usages, self._reasoning_tokens())
        out = {**self._head(False), "choices": choices, "usage": usage}
        if self.req.return_token_ids and self.req.chat:  # (chat: one prompt)
            out["prompt_token_ids"] = self._prompt_ids(0)
        return out
