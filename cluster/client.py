"""A small gRPC client for the kvcluster.v1 API (used by the CLI, benchmarks and tests)."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from cluster.client_errors import ClientCancelled
from cluster.client_stream import ClientStream
from cluster.deadline_watch import DeadlineWatch
from cluster.router_addresses import REFRESH_S, RouterAddresses
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc

# A streamed call still open this long past its deadline is cancelled by the client itself:
# a caller's timeout must hold whatever gRPC's own deadline did.
DEADLINE_GUARD_S = 2.0

# gRPC's own retry policy stays off: its retry filter can wedge a call when the retry timer
# and the call's deadline or cancellation race (grpc/grpc#41036, grpcio >= 1.72): neither the
# deadline nor cancel() ends the call, and every later call on the channel blocks in its
# creation (seen as a 5 s call blocked for minutes right after a router restart). The client
# makes its own attempts instead (ClientStream, _unary_call), which also resume a stream.
CHANNEL_RETRIES = ("grpc.enable_retries", 0)
MAX_RETRIES = 16  # more attempts of one call than this is a loop, not a retry

FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_UNSPECIFIED: None,
}


@dataclass
class Completion:
    """The gathered result of one streamed Generate call."""

    request_id: str = ""
    worker_id: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # sample index -> text
    # sample index -> its reasoning (split_reasoning on a reasoning model)
    reasonings: dict[int, str] = field(default_factory=dict)
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
    split_reasoning: bool = False,
    **params: object,
) -> pb.GenerateRequest:
    """``prompt``: text, token ids, or chat messages ([{"role": ..., "content": ...}], rendered
    by the router with the model's chat template). ``params`` are SamplingParams fields
    (max_tokens=..., temperature=..., stop=[...]); ``lora``: a LoRA adapter's name (empty:
    the base model); ``split_reasoning``: a reasoning model's reasoning apart from the text
    (``Completion.reasonings``)."""
    req = pb.GenerateRequest(
        request_id=request_id,
        cache_salt=cache_salt,
        tenant=tenant,
        priority=priority,
        lora=lora,
        split_reasoning=split_reasoning,
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


# gRPC's name-resolver schemes: a target starting "<scheme>:" is one gRPC target
GRPC_SCHEMES = frozenset({"dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds"})


def router_targets(target: str | Sequence[str]) -> list[str]:
    """The gRPC targets a client calls: ``target`` split at commas (``"a:1,b:2"``, or a list
    of addresses), each its own channel; a target with a gRPC scheme (``ipv4:a:1,b:2``,
    ``dns:///...``) is one channel that gRPC balances itself."""
    if isinstance(target, str):
        if target.split(":", 1)[0] in GRPC_SCHEMES:
            return [target]
        parts = target.split(",")
    else:
        parts = list(target)
    out = [p.strip() for p in parts if p.strip()]
    if not out:
        raise ValueError(f"no router address in {target!r}")
    return out


class KVClusterClient:
    def __init__(
        self,
        target: str | Sequence[str],
        *,
        token: str | None = None,
        root_cert: bytes | None = None,
        max_message_bytes: int = 4 << 20,
        retries: int = 3,
        discover: bool | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        """``target``: one router address, several (``"a:1,b:2"`` or a list: each call
        starts at the next one in turn and fails over to the following ones), or a gRPC
        multi-address target (``ipv4:a:p1,b:p2``, one channel, tried in order).
        ``retries``: more attempts of a call that failed ``UNAVAILABLE`` (before any answer,
        or a stream resumed after the tokens it delivered), each on the next address, with
        back-off after every full round (one address: 0.1 s, 0.2 s, ... up to 1 s).
        ``discover``: keep the addresses current from the cluster's router list
        (:class:`RouterAddresses`, every ``refresh_s`` and after a failover; never for a gRPC
        multi-address target). None: when given several addresses (one address is a router
        the caller chose, or a load balancer)."""
        given = router_targets(target)
        if not 0 <= retries <= MAX_RETRIES:
            raise ValueError(f"retries must be in [0, {MAX_RETRIES}], got {retries}")
        self.retries = retries
        opts = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            CHANNEL_RETRIES,
        ]
        creds = grpc.ssl_channel_credentials(root_cert) if root_cert is not None else None

        def make_channel(address: str) -> grpc.Channel:
            if creds is not None:
                return grpc.secure_channel(address, creds, options=opts)
            return grpc.insecure_channel(address, options=opts)

        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        one_channel = given[0].split(":", 1)[0] in GRPC_SCHEMES
        self.addresses = RouterAddresses(
            given,
            make_channel,
            metadata=self.metadata,
            discover=(len(given) > 1 if discover is None else discover) and not one_channel,
            refresh_s=refresh_s,
        )
        self._watch = DeadlineWatch()
        # where its calls start in the rotation: clients that refreshed to the same list
        # still spread their calls over the routers
        self._turn = itertools.count(random.randrange(1 << 16))

    @property
    def targets(self) -> list[str]:
        """The addresses calls go to now."""
        return self.addresses.current()[0]

    @property
    def channel(self) -> grpc.Channel:
        """The first address's channel."""
        return self.addresses.channel(self.targets[0])

    @property
    def stub(self) -> pb_grpc.KVClusterStub:
        """The first address's stub."""
        return self.addresses.current()[1][0]

    def close(self) -> None:
        self._watch.close()
        self.addresses.close()

    def __enter__(self) -> KVClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stubs(self) -> list[pb_grpc.KVClusterStub]:
        """The stubs of a new call (a refresh may be started for later ones)."""
        self.addresses.maybe_refresh()
        return self.addresses.current()[1]

    @property
    def attempts(self) -> int:
        """Attempts of one call at most: the first and ``retries`` more."""
        return self.retries + 1

    def _start(self, stubs: Sequence[object]) -> int:
        return next(self._turn) % len(stubs)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None) -> ClientStream:
        """The call's messages; with ``timeout``, a call still open ``DEADLINE_GUARD_S``
        past it is cancelled here (its reader gets ``CANCELLED``), whatever gRPC's own
        deadline did. See :class:`ClientStream` for failover."""
        stubs = self._stubs()
        return ClientStream(
            stubs,
            self._start(stubs),
            request,
            timeout=timeout,
            metadata=self.metadata,
            attempts=self.attempts,
            backoff_s=lambda tried: self._backoff_s(tried, len(stubs)),
            watch=self._watch,
            guard_s=DEADLINE_GUARD_S,
            on_failover=self.addresses.failed_over,
        )

    @staticmethod
    def _backoff_s(tried: int, n: int) -> float:
        """Pause before attempt ``tried`` + 1 over ``n`` addresses: none while addresses not
        yet tried in this round are left, then 0.1 s doubling per round (up to 1 s)."""
        if tried % n:
            return 0.0
        return min(1.0, 0.1 * 2 ** (tried // n - 1))

    def _unary_call(self, method: str, request: object, timeout: float | None) -> object:
        """One unary call with failover (as :class:`ClientStream`) and its deadline held:
        the caller waits at most ``timeout + DEADLINE_GUARD_S``, then the call is cancelled
        and ``CANCELLED`` raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stubs = self._stubs()
        start, attempts = self._start(stubs), self.attempts
        for tried in range(attempts):
            stub = stubs[(start + tried) % len(stubs)]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            future = getattr(stub, method).future(
                request, timeout=remaining, metadata=self.metadata
            )
            wait = None if remaining is None else remaining + DEADLINE_GUARD_S
            try:
                return future.result(timeout=wait)
            except grpc.FutureTimeoutError:
                future.cancel()
                raise ClientCancelled(
                    f"{method} still open {DEADLINE_GUARD_S} s past its {timeout} s deadline"
                ) from None
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.addresses.failed_over()
                pause = self._backoff_s(tried + 1, len(stubs))
                late = deadline is not None and time.monotonic() + pause >= deadline
                if exc.code() != grpc.StatusCode.UNAVAILABLE or tried + 1 == attempts or late:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")

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
        return self._unary_call("GenerateUnary", build_request(prompt, **kwargs), timeout)

    def tokenize(self, text: str) -> list[int]:
        return list(self._unary_call("Tokenize", pb.TokenizeRequest(text=text), 30).token_ids)

    def status(self, timeout: float = 30.0) -> pb.ClusterStatusResponse:
        return self._unary_call("ClusterStatus", pb.ClusterStatusRequest(), timeout)


def accumulate(out: Completion, msg: pb.GenerateResponse) -> None:
    out.num_messages += 1
    out.request_id = msg.request_id or out.request_id
    out.worker_id = msg.worker_id or out.worker_id
    out.texts[msg.index] = out.texts.get(msg.index, "") + msg.text
    if msg.reasoning:
        out.reasonings[msg.index] = out.reasonings.get(msg.index, "") + msg.reasoning
    out.token_ids.setdefault(msg.index, []).extend(msg.token_ids)
    if msg.finish_reason:
        out.finish_reasons[msg.index] = FINISH_NAMES[msg.finish_reason]
    if msg.HasField("usage"):
        out.prompt_tokens = msg.usage.prompt_tokens
        out.cached_tokens = msg.usage.cached_tokens
        out.completion_tokens = msg.usage.completion_tokens
