"""Protobuf at the edge: kvcluster.v1 messages <-> the engine's and router's dataclasses.

Nothing past the servicer sees a protobuf message. Every rule broken raises the engine's
:class:`InvalidRequest` (field, value, limit), which the servicer maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from worker.engine import InvalidRequest, RequestOutput, SamplingParams
from worker.engine.outputs import FinishReason

MAX_REQUEST_ID_CHARS = 128
MAX_TENANT_CHARS = 64
MAX_PROMPT_CHARS = 1 << 20  # text prompts; token limits are checked after tokenizing
MAX_STOP_STRING_CHARS = 256

FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}

_OPTIONAL_PARAMS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
                    "seed", "n", "beam_width", "length_penalty", "ignore_eos", "logprobs")


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A validated Generate request, protobuf-free."""

    request_id: str  # client's id or a generated one
    text: str | None  # the prompt text (None when token ids were sent)
    token_ids: list[int] | None  # the prompt's token ids (None until tokenized, for text)
    params: SamplingParams  # validated sampling parameters (cache_salt, priority folded in)
    tenant: str  # tenant name ("" = anonymous)
    stream_text: bool  # send text deltas (else token ids only)


def _check_str(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(field, f"<{len(value)} chars>", f"must be at most {limit} characters")


def params_from_pb(msg: pb.SamplingParams, *, priority: int,
                   cache_salt: str | None) -> SamplingParams:
    values: dict[str, object] = {}
    for name in _OPTIONAL_PARAMS:
        if msg.HasField(name):
            v = getattr(msg, name)
            if isinstance(v, float) and not math.isfinite(v):
                raise InvalidRequest(name, v, "must be a finite number")
            values[name] = v
    if values.get("top_k") == 0:
        values["top_k"] = None
    if values.get("logprobs") == 0:
        values.pop("logprobs")
    for s in msg.stop:
        _check_str("stop", s, MAX_STOP_STRING_CHARS)
    values["stop"] = tuple(msg.stop)
    values["stop_token_ids"] = tuple(msg.stop_token_ids)
    values["priority"] = priority
    values["cache_salt"] = cache_salt
    return SamplingParams(**values)


def spec_from_pb(req: pb.GenerateRequest, *, default_salt: str | None = None) -> GenerateSpec:
    """Validate and convert a GenerateRequest (model limits are checked later, by the caller)."""
    _check_str("request_id", req.request_id, MAX_REQUEST_ID_CHARS)
    _check_str("tenant", req.tenant, MAX_TENANT_CHARS)
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt", None, "set exactly one of text or token_ids")
    text = token_ids = None
    if which == "text":
        if not req.text:
            raise InvalidRequest("text", "", "must be a non-empty string")
        _check_str("text", req.text, MAX_PROMPT_CHARS)
        text = req.text
    else:
        token_ids = list(req.token_ids.ids)
        if not token_ids:
            raise InvalidRequest("token_ids", [], "must hold at least one token id")
    salt = req.cache_salt or default_salt or None
    params = params_from_pb(req.params, priority=req.priority, cache_salt=salt)
    return GenerateSpec(
        request_id=req.request_id or uuid.uuid4().hex,
        text=text,
        token_ids=token_ids,
        params=params,
        tenant=req.tenant,
        stream_text=req.stream_text if req.HasField("stream_text") else True,
    )


def responses_from_output(out: RequestOutput, *, worker_id: str, stream_text: bool
                          ) -> list[pb.GenerateResponse]:
    """One engine output -> one GenerateResponse per changed sample; usage on the last."""
    msgs = []
    for d in out.outputs:
        msg = pb.GenerateResponse(request_id=out.request_id, index=d.index,
                                  token_ids=d.token_ids, text=d.text if stream_text else "",
                                  finish_reason=FINISH_TO_PB[d.finish_reason],
                                  worker_id=worker_id)
        if d.logprobs:
            for lp in d.logprobs:
                entries = [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob)]
                entries += [pb.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top]
                msg.logprobs.append(pb.TopLogprobs(entries=entries))
        msgs.append(msg)
    if out.finished:
        if not msgs:
            msgs.append(pb.GenerateResponse(request_id=out.request_id, worker_id=worker_id))
        u = out.usage
        msgs[-1].usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens,
                                         cached_tokens=u.cached_tokens,
                                         completion_tokens=u.completion_tokens))
    return msgs
