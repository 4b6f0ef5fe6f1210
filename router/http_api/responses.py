"""Engine outputs -> OpenAI response objects (whole responses and stream chunks)."""

from __future__ import annotations

from typing import Any

from kvstore.blocks.outputs import Completion, CompletionDelta, TokenLogprob, Usage
from router.http_api.protocol import OpenAIRequest
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
    """Builds one request's response objects; choice index = prompt index * n + sample.
    ``echoes``: per prompt, the text put before its completions (``echo``)."""

    def __init__(
        self, req: OpenAIRequest, n: int, tokenizer: Tokenizer, echoes: list[str] | None = None
    ) -> None:
        self.req = req
        self.n = n
        self.tok = tokenizer
        self.kind = "chat.completion" if req.chat else "text_completion"
        self.echoes = echoes or []
        self._offsets: dict[int, int] = {}  # choice -> characters of text before its next token

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

    def logprobs_json(self, lps: list[TokenLogprob] | None, choice: int) -> dict[str, Any] | None:
        k = self.req.top_logprobs
        if k is None or lps is None:
            return None
        if self.req.chat:  # OpenAI: the k most likely, the sampled token or not

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
        # completions: the k most likely and the sampled token (k + 1 entries when it is
        # not among them), as OpenAI and vLLM answer
        tokens = [self._piece(x.token_id) for x in lps]
        tops = []
        for x, piece in zip(lps, tokens, strict=True):
            top = {self._piece(t): v for t, v in x.top[:k]}
            top.setdefault(piece, x.logprob)
            tops.append(top)
        offsets = []
        at = self._offsets.get(choice, len(self._echo(choice)))
        for piece in tokens:
            offsets.append(at)
            at += len(piece)
        self._offsets[choice] = at
        return {
            "tokens": tokens,
            "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _echo(self, choice: int) -> str:
        if not self.req.echo:
            return ""
        return self.echoes[choice // self.n]

    def chunk(
        self, prompt_idx: int, d: CompletionDelta, first: bool, usage: Usage | None = None
    ) -> dict[str, Any]:
        """One stream event for one sample's new output (``usage``: the prompt's so far,
        with continuous_usage_stats)."""
        index = prompt_idx * self.n + d.index
        reason = d.finish_reason.value if d.finish_reason else None
        lp = self.logprobs_json(d.logprobs, index)
        if self.req.chat:
            delta: dict[str, Any] = {"content": d.text}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            text = (self._echo(index) if first else "") + d.text
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        out = {**self._head(True), "choices": [choice]}
        if self.req.continuous_usage and usage is not None:
            out["usage"] = usage_json([usage])
        elif self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usages: list[Usage]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage_json(usages)}

    def whole(
        self, completions: list[tuple[int, Completion]], usages: list[Usage]
    ) -> dict[str, Any]:
        choices = []
        for prompt_idx, c in completions:
            index = prompt_idx * self.n + c.index
            reason = c.finish_reason.value if c.finish_reason else None
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": self.logprobs_json(c.logprobs, index),
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
            if self.req.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = self._echo(index) + c.text
            choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {**self._head(False), "choices": choices, "usage": usage_json(usages)}
