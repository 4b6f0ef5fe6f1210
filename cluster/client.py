"""A small gRPC client for the kvcluster.v1 API (used by the CLI, benchmarks and tests)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc

# A streamed call still open this long past its deadline is cancelled by the client itself:
# grpcio's sync streams with retries enabled can miss their deadline when the server dies
# and comes back on the same port (seen as a 5 s call blocked for minutes after a router
# restart), and a caller's timeout must hold.
DEADLINE_GUARD_S = 2.0

FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_UNSPECIFIED: None,
}


def retry_service_config(retries: int) -> str:
    """gRPC service config retrying every kvcluster.v1 call that failed ``UNAVAILABLE`` before
    the server answered anything, up to ``retries`` more times with exponential back-off.

    Such a call did nothing: it was written to a connection that had just died (a killed
    router, before the channel noticed), or the router had no live worker. gRPC never retries
    a call once a response arrived, so a stream that delivered tokens is not replayed."""
    if not 0 <= retries <= 4:  # gRPC caps maxAttempts at 5
        raise ValueError(f"retries must be in [0, 4], got {retries}")
    if retries == 0:
        return json.dumps({"methodConfig": []})
    policy = {
        "maxAttempts": retries + 1,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    service = pb.DESCRIPTOR.services_by_name["KVCluster"].full_name
    return json.dumps({"methodConfig": [{"name": [{"service": service}], "retryPolicy": policy}]})


@dataclass
class Completion:
    """The gathered result of one streamed Generate call."""

    request_id: str = ""
    worker_id: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # sample index -> text
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # sample index -> tokens
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    num_messages: int = 0

    @property
    def text(self) -> str:
        return self.texts.get(0, "")


Prompt = str | list[int] | list[Mapping[str, str]]  # text, token ids, or chat messages


def chat(user: str, system: str | None = None) -> list[dict[str, str]]:
    """The messages of a one-question chat, with an optional system prompt."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": user}]


def build_request(
    prompt: Prompt,
    *,
    request_id: str = "",
    cache_salt: str = "",
    tenant: str = "",
    priority: int = 0,
    lora: str = "",
    **params: object,
) -> pb.GenerateRequest:
    """``prompt``: text, token ids, or chat messages ([{"role": ..., "content": ...}], rendered
    by the router with the model's chat template). ``params`` are SamplingParams fields
    (max_tokens=..., temperature=..., stop=[...]); ``lora``: a LoRA adapter's name (empty:
    the base model)."""
    req = pb.GenerateRequest(
        request_id=request_id,
        cache_salt=cache_salt,
        tenant=tenant,
        priority=priority,
        lora=lora,
        params=pb.SamplingParams(**params),
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        for m in prompt:
            req.messages.messages.add(role=m["role"], content=m["content"])
    else:
        req.token_ids.ids.extend(prompt)
    return req


class KVClusterClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        root_cert: bytes | None = None,
        max_message_bytes: int = 4 << 20,
        retries: int = 3,
    ) -> None:
        """``target``: one address or a gRPC multi-address target (``ipv4:a:p1,b:p2``, tried
        in order); ``retries``: see :func:`retry_service_config`."""
        opts = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", retry_service_config(retries)),
        ]
        if root_cert is not None:
            self.channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(root_cert), options=opts
            )
        else:
            self.channel = grpc.insecure_channel(target, options=opts)
        self.stub = pb_grpc.KVClusterStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> KVClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[pb.GenerateResponse]:
        """The call's messages; with ``timeout``, a call still open ``DEADLINE_GUARD_S``
        past it is cancelled here (its reader gets ``CANCELLED``), whatever gRPC's own
        deadline did."""
        call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata)
        if timeout is not None:
            guard = threading.Timer(timeout + DEADLINE_GUARD_S, call.cancel)
            guard.daemon = True
            guard.start()
            call.add_done_callback(lambda _call: guard.cancel())
        return call

    def generate(
        self, prompt: Prompt, *, timeout: float | None = 120.0, **kwargs: object
    ) -> Completion:
        out = Completion()
        for msg in self.stream(build_request(prompt, **kwargs), timeout=timeout):
            accumulate(out, msg)
        return out

    def unary(
        self, prompt: Prompt, *, timeout: float | None = 120.0, **kwargs: object
    ) -> pb.GenerateResult:
        return self.stub.GenerateUnary(
            build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata
        )

    def tokenize(self, text: str) -> list[int]:
        return list(
            self.stub.Tokenize(
                pb.TokenizeRequest(text=text), metadata=self.metadata, timeout=30
            ).token_ids
        )

    def status(self) -> pb.ClusterStatusResponse:
        return self.stub.ClusterStatus(
            pb.ClusterStatusRequest(), metadata=self.metadata, timeout=30
        )


def accumulate(out: Completion, msg: pb.GenerateResponse) -> None:
    out.num_messages += 1
    out.request_id = msg.request_id or out.request_id
    out.worker_id = msg.worker_id or out.worker_id
    out.texts[msg.index] = out.texts.get(msg.index, "") + msg.text
    out.token_ids.setdefault(msg.index, []).extend(msg.token_ids)
    if msg.finish_reason:
        out.finish_reasons[msg.index] = FINISH_NAMES[msg.finish_reason]
    if msg.HasField("usage"):
        out.prompt_tokens = msg.usage.prompt_tokens
        out.cached_tokens = msg.usage.cached_tokens
        out.completion_tokens = msg.usage.completion_tokens
