"""The gRPC server's interceptors: token auth on the kvcluster service, and the decode
guard that turns a request the server cannot parse into an INVALID_ARGUMENT naming what is
wrong (instead of grpc's opaque failure)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import grpc

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.edge.convert import malformed_reason
from router.serving.auth import TokenAuth
from router.serving.request_errors import BadBody

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCluster"].full_name


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects API calls without a valid ``authorization: Bearer <token>`` (UNAUTHENTICATED).

    Health checks and reflection stay open (probes carry no token).
    """

    def __init__(self, auth: TokenAuth) -> None:
        self.auth = auth

    async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
        handler = await continuation(details)
        if (
            details.method.startswith(f"/{SERVICE_NAME}/")
            and handler is not None
            and self.auth.tenant_of(details.invocation_metadata) is None
        ):
            return _deny_handler(handler)
        return handler


def _rewrap(
    handler: grpc.RpcMethodHandler, behaviour: Any, deserializer: Any = None
) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (unary or server-streaming response) running
    ``behaviour(request, context)``: an async function for a unary response or a stream on
    grpc's writer API (``await context.write``), an async generator function for a stream
    of yields (grpc runs it as it is: each streamed message passes no generator of ours but
    ``behaviour``, and a streamed token's cost is mostly such hops)."""
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        behaviour,
        request_deserializer=deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or invalid bearer token (metadata 'authorization')",
        )

    if handler.response_streaming:

        async def deny_stream(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            await deny(request, context)
            yield  # pragma: no cover - abort raises

        return _rewrap(handler, deny_stream)
    return _rewrap(handler, deny)


class Malformed(BadBody):
    """A request whose bytes do not parse (corrupt wire format, a string field that is not
    UTF-8); stands in for the message so the handler can answer INVALID_ARGUMENT."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # names the field when it can (see convert.malformed_reason)


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Unparseable API requests get INVALID_ARGUMENT naming the field, not grpc's UNKNOWN."""

    async def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
        handler = await continuation(details)
        if (
            handler is None
            or handler.request_streaming
            or handler.request_deserializer is None
            or not details.method.startswith(f"/{SERVICE_NAME}/")
        ):
            return handler
        parse = handler.request_deserializer
        descriptor = parse.__self__.DESCRIPTOR

        def lenient(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # DecodeError; any parse failure is the client's
                return Malformed(malformed_reason(descriptor, data, exc))

        if handler.response_streaming and inspect.iscoroutinefunction(handler.unary_stream):
            writer = handler.unary_stream

            # a handler on grpc's writer API: the check is the call's start, and its
            # messages pass nothing of the guard's
            async def guarded_writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                await writer(request, context)

            return _rewrap(handler, guarded_writer, lenient)
        if handler.response_streaming:
            stream = handler.unary_stream

            async def guarded_stream(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                async for item in stream(request, context):
                    yield item

            return _rewrap(handler, guarded_stream, lenient)
        unary = handler.unary_unary

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            return await unary(request, context)

        return _rewrap(handler, guarded, lenient)
