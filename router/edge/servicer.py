"""The kvcluster.v1 gRPC servicer (grpc.aio), health and reflection services; auth and
the decode guard are interceptors (``interceptors.py``).

Protobuf stops here: requests become :class:`router.serving.generate_spec.GenerateSpec`, the
serving core works on dataclasses, and errors map to status codes through the one error table
(:func:`router.serving.request_errors.classify`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.blocks.tiers import Tier
from kvstore.requests.outputs import GenerationResult
from kvstore.requests.protocol import TierFigures, WorkerStatus
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc
from router.edge.convert import (
    FINISH_TO_PB,
    responses_from_output,
    spec_from_pb,
    top_logprobs_pb,
)
from router.edge.interceptors import SERVICE_NAME, AuthInterceptor, DecodeGuard
from router.edge.reasoning_messages import ReasoningMessages
from router.placement.prediction import WorkerPredictions
from router.serving.auth import TokenAuth
from router.serving.edge_intake import Intake
from router.serving.generate_spec import GenerateSpec
from router.serving.request_errors import RequestFailed, classify
from router.serving.tokenizing import check_text_chars

__all__ = ["KVClusterServicer", "RequestFailed", "TokenAuth", "start_server"]

log = logging.getLogger(__name__)
# A connection has this long to complete its HTTP/2 handshake, and one with no call under
# way is closed (a GOAWAY: a client's channel reconnects on its next call) after IDLE_S, as
# the HTTP edge closes idle sockets: grpc's own defaults (120 s, never) let idle sockets pile
# up until the router's process runs out of file descriptors, the HTTP edge's included.
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_S = 30.0


class KVClusterServicer(pb_grpc.KVClusterServicer):
    def __init__(
        self,
        intake: Intake,
        *,
        policy: str,
        index_available: Any = lambda: False,
        routers: Callable[[], Sequence[tuple[str, str | None]]] = tuple,
    ) -> None:
        """``intake``: the router's front door (auth, limits, tokenizer), shared with its HTTP
        edge; ``policy``: the routing policy's name (for ClusterStatus); ``routers``: every
        router of the cluster as this one was last told, (gRPC address, HTTP URL or None)."""
        self.intake = intake
        self.routers = routers
        self.core = intake.core
        self.limits = intake.limits
        self.tokenize = intake.tokenize
        self.policy = policy
        self.index_available = index_available
        self.auth = intake.auth

    async def _start(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[GenerateSpec, list[int]]:
        """The validated request and its prompt's token ids."""
        await self.intake.turn()  # a burst's parsing spread over loop iterations
        # the tenant scopes the cache salt: no KV and no routing signal crosses tenants
        tenant = self.intake.tenant(context.invocation_metadata(), request.tenant)
        self.core.check_room()  # full queues: refused before the request is validated
        spec = spec_from_pb(request, tenant=tenant, limits=self.limits)
        return spec, await self.intake.token_ids(spec)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # grpc's writer API: each message is one await of grpc's own write, with no
        # generator between the intake's stream and grpc (an async-generator handler puts
        # grpc's loop and every wrapping generator between them); the stream is closed
        # here, so a client gone mid-write aborts its request at once
        try:
            spec, token_ids = await self._start(request, context)
            text = spec.stream_text
            splits = self._splits(request, spec, token_ids) if text else None
            async with aclosing(self.intake.generate(spec, token_ids)) as outputs:
                async for worker, out in outputs:
                    for msg in responses_from_output(out, worker_id=worker, stream_text=text):
                        if splits is not None:
                            splits.apply(msg)
                        await context.write(msg)
        except Exception as exc:
            await self._abort(context, exc)

    async def GenerateUnary(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResult:
        result = GenerationResult(request_id="", completions=[])
        worker = ""
        splits = None
        try:
            spec, token_ids = await self._start(request, context)
            splits = self._splits(request, spec, token_ids)
            async for worker, out in self.intake.generate(spec, token_ids):  # noqa: B007
                result.request_id = out.request_id
                result.add(out)
        except Exception as exc:
            await self._abort(context, exc)

        u = result.usage
        completions = [
            pb.Completion(
                index=c.index,
                token_ids=c.token_ids,
                text=c.text,
                finish_reason=FINISH_TO_PB[c.finish_reason],
                logprobs=top_logprobs_pb(c.logprobs or ()),
            )
            for c in result.completions
        ]
        if splits is not None:
            for c in completions:
                splits.apply(c)
        return pb.GenerateResult(
            request_id=result.request_id,
            worker_id=worker,
            completions=completions,
            prompt_logprobs=top_logprobs_pb(result.prompt_logprobs or ()),
            usage=pb.Usage(
                prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens,
                completion_tokens=u.completion_tokens,
                host_cached_tokens=u.host_cached_tokens,
            )
            if u
            else None,
        )

    def _splits(
        self, request: pb.GenerateRequest, spec: GenerateSpec, token_ids: list[int]
    ) -> ReasoningMessages | None:
        """The reasoning splits of a request that asked for them (None: it did not, or the
        model has no reasoning tokens)."""
        markers = self.intake.reasoning
        if not request.split_reasoning or markers is None:
            return None
        earlier = spec.continue_from
        return ReasoningMessages(
            markers, markers.prompt_state(token_ids), earlier, self.intake.tokenizer
        )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            check_text_chars("text", request.text, self.limits, self.core.limits.max_model_len)
            ids = await self.tokenize.encode(request.text, add)
        except Exception as exc:
            await self._abort(context, exc)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.core.limits.max_model_len)

    async def ClusterStatus(
        self, request: pb.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClusterStatusResponse:
        statuses = await self.core.directory.statuses()
        # a tenant sees only the adapters it may use (no auth: those registered for all)
        tenant = self.auth.tenant_of(context.invocation_metadata()) if self.auth else None
        live = await self.core.directory.candidates()
        snap = self.core.router.metrics.snapshot()
        predicted = self.core.predictions.workers if self.core.predictions is not None else {}
        breaker = getattr(self.core.directory, "breaker", None)
        return pb.ClusterStatusResponse(
            index_circuit_open=breaker is not None and breaker.is_open,
            index_reads_skipped=breaker.skipped if breaker is not None else 0,
            prediction_misses=sum(p.misses for p in predicted.values()),
            index_resyncs=sum(p.resyncs for p in predicted.values()),
            policy=self.policy,
            model_id=self.core.limits.model_id,
            index_available=bool(self.index_available()),
            decisions={k: int(v) for k, v in snap["decisions"].items()},  # type: ignore[union-attr]
            workers=[
                worker_status_pb(s, s.worker_id in live, tenant, predicted.get(s.worker_id))
                for s in statuses
            ],
            routers=[pb.RouterAddress(grpc_address=g, http_url=h or "") for g, h in self.routers()],
        )

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        mapped = classify(exc)
        self.intake.metrics.failures.labels(str(mapped.http_status)).inc()
        if mapped.retry_after_s is not None:  # honoured by gRPC's retry policy
            pushback = str(mapped.retry_after_s * 1000)
            context.set_trailing_metadata((("grpc-retry-pushback-ms", pushback),))
        await context.abort(mapped.grpc_code, mapped.message)


_NO_TIER = TierFigures(0)


def worker_status_pb(
    s: WorkerStatus, live: bool, tenant: str | None, predicted: WorkerPredictions | None
) -> pb.WorkerStatus:
    """One worker's ClusterStatus entry: its status, whether the router counts it live, the
    adapters ``tenant`` may see and this router's predictions for it."""
    host = s.tiers.get(Tier.HOST, _NO_TIER)
    return pb.WorkerStatus(
        worker_id=s.worker_id,
        epoch=s.epoch or 0,
        alive=live and not s.stale,
        running=s.running,
        waiting=s.waiting,
        free_blocks=s.free_blocks,
        total_blocks=s.total_blocks,
        kv_usage=1 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0,
        prefix_hit_rate=s.prefix_hit_rate,
        queued_prefill_tokens=s.queued_prefill_tokens,
        waiting_pinned_blocks=s.waiting_pinned_blocks,
        tenant_quota_evictions=s.tenant_quota_evictions,
        stale=s.stale,
        heartbeat_age_s=s.heartbeat_age_s,
        model_load_s=s.model_load_s,
        host_total_blocks=host.total_blocks,
        host_cached_blocks=host.cached_blocks,
        host_hit_tokens=host.hit_tokens,
        swap_preemptions=s.swap_preemptions,
        recompute_preemptions=s.recompute_preemptions,
        adapters=[
            pb.AdapterStatus(name=a.name, adapter_id=a.adapter_id, loaded=a.loaded)
            for a in s.adapters
            if not a.tenants or tenant in a.tenants
        ],
        **_prediction_fields(predicted),
    )


def _prediction_fields(p: WorkerPredictions | None) -> dict[str, int | float]:
    """WorkerStatus fields 14-19 and 26-30 from this router's predictions for one worker."""
    if p is None:
        return {}
    return dict(
        predicted_cached_tokens=p.predicted_tokens,
        realised_cached_tokens=p.realised_tokens,
        prediction_placements=p.placements,
        prediction_misses=p.misses,
        recent_cache_gap_tokens=p.mean_abs_gap(),
        index_resyncs=p.resyncs,
        pulls=p.pulls,
        pulled_tokens=p.pulled_tokens,
        pull_misses=p.pull_misses,
        pull_slow=p.pull_slow,
        pull_evicted=p.pull_evicted,
    )


async def start_server(
    servicer: KVClusterServicer,
    *,
    host: str,
    port: int,
    max_message_bytes: int,
    tls: tuple[bytes, bytes] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with the API, health and reflection; returns (server, port)."""
    # auth first: an unauthenticated caller learns nothing, not even that its bytes are bad
    interceptors: list[grpc.aio.ServerInterceptor] = [DecodeGuard()]
    if servicer.auth is not None:
        interceptors.insert(0, AuthInterceptor(servicer.auth))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
            ("grpc.max_connection_idle_ms", int(IDLE_S * 1000)),
        ],
    )
    pb_grpc.add_KVClusterServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    addr = f"{host}:{port}"
    if tls is not None:
        creds = grpc.ssl_server_credentials([(tls[1], tls[0])])  # (key, cert)
        bound = server.add_secure_port(addr, creds)
    else:
        bound = server.add_insecure_port(addr)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
