"""Engine outputs -> OpenAI response objects (whole responses and stream chunks)."""

from __future__ import annotations

from typing import Any

from kvstore.blocks.outputs import Completion, CompletionDelta, TokenLogprob, Usage
from router.http_api.protocol import OpenAIRequest
from router.http_api.tools import ToolStream, message_json, tool_chunk_delta
from worker.model.tokenizer import Tokenizer


def usage_json(usages: list[Usage]) -> dict[str, Any]:
    """Summed over a batch's prompts; ``cached_tokens``: prompt tokens served from KV cache."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)},
    }


class Shaper:
    """Builds one request's response objects; choice index = prompt index * n + sample."""

    def __init__(self, req: OpenAIRequest, n: int, tokenizer: Tokenizer) -> None:
        self.req = req
        self.n = n
        self.tok = tokenizer
        self.kind = "chat.completion" if req.chat else "text_completion"
        self._tool_streams: dict[int, ToolStream] = {}  # chat with tools: per choice

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = self.kind + (".chunk" if chunk and self.req.chat else "")
        return {
            "id": self.req.response_id,
            "object": obj,
            "created": self.req.created,
            "model": self.req.model,
        }

    def _piece(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def logprobs_json(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        k = self.req.top_logprobs
        if k is None or lps is None:
            return None
        if self.req.chat:

            def entry(t: int, lp: float) -> dict[str, Any]:
                s = self._piece(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {
                "content": [
                    {
                        **entry(x.token_id, x.logprob),
                        "top_logprobs": [entry(t, v) for t, v in x.top[:k]],
                    }
                    for x in lps
                ]
            }
        return {
            "tokens": [self._piece(x.token_id) for x in lps],
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{self._piece(t): v for t, v in x.top[:k]} for x in lps],
            "text_offset": [],
        }

    def chunk(self, prompt_idx: int, d: CompletionDelta, first: bool) -> dict[str, Any]:
        """One stream event for one sample's new output."""
        index = prompt_idx * self.n + d.index
        reason = d.finish_reason.value if d.finish_reason else None
        lp = self.logprobs_json(d.logprobs)
        if self.req.chat:
            delta: dict[str, Any] = {"content": d.text}
            if self.req.tools is not None:
                stream = self._tool_streams.setdefault(index, ToolStream(self.req.tools))
                delta, reason = tool_chunk_delta(stream, d.text, reason)
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": index, "text": d.text, "logprobs": lp, "finish_reason": reason}
        out = {**self._head(True), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usages: list[Usage]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage_json(usages)}

    def whole(
        self, completions: list[tuple[int, Completion]], usages: list[Usage]
    ) -> dict[str, Any]:
        choices = []
        for prompt_idx, c in completions:
            reason = c.finish_reason.value if c.finish_reason else None
            lp = self.logprobs_json(c.logprobs)
            choice: dict[str, Any] = {
                "index": prompt_idx * self.n + c.index,
                "logprobs": lp,
                "finish_reason": reason,
            }
            if self.req.chat:
                choice["message"], tool_reason = message_json(c.text, self.req.tools)
                choice["finish_reason"] = tool_reason or reason
            else:
                choice["text"] = c.text
            choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {**self._head(False), "choices": choices, "usage": usage_json(usages)}
