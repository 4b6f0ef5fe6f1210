"""A router's two edges over an intake of their own, for tests that bring their own serving
core and tokenizer (no Ray): the HTTP server closes its intake when it stops."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from router.edge.servicer import KVClusterServicer
from router.http_api import OpenAIServer
from router.placement.config import RequestLimits
from router.serving.auth import TokenAuth
from router.serving.edge_intake import Intake
from worker.model.reasoning_markers import ReasoningMarkers


def http_server(
    core: Any,
    tokenizer: Any,
    *,
    limits: RequestLimits | None = None,
    auth: TokenAuth | None = None,
    reasoning: ReasoningMarkers | None = None,
    **kw: Any,
) -> OpenAIServer:
    """``kw``: OpenAIServer's options (``max_body_bytes`` defaults to 1 MiB);
    ``reasoning``: the served model's reasoning markers (None: a model without them)."""
    kw.setdefault("max_body_bytes", 1 << 20)
    intake = Intake(
        core, tokenizer, auth=auth, limits=limits or RequestLimits(), reasoning=reasoning
    )
    return OpenAIServer(intake, close_intake=True, **kw)


def grpc_servicer(
    core: Any,
    tokenizer: Any,
    *,
    limits: RequestLimits | None = None,
    reasoning: ReasoningMarkers | None = None,
) -> KVClusterServicer:
    intake = Intake(
        core, tokenizer, auth=None, limits=limits or RequestLimits(), reasoning=reasoning
    )
    return KVClusterServicer(intake, policy="x")


def with_openai(
    core: Any, tokenizer: Any, ask: Callable[[Any], Any], *, api_key: str = "x", **kw: Any
) -> Any:
    """``ask(client)`` with an ``openai`` client of an HTTP server over ``core``, run in a
    thread while the server serves (on loopback, stopped after); ``kw``: the server's
    options (:func:`http_server`'s, ``auth`` and ``reasoning`` too)."""
    import openai

    server = http_server(core, tokenizer, **kw)

    async def main() -> Any:
        port = await server.start("127.0.0.1", 0)
        try:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=30
            )
            return await asyncio.get_running_loop().run_in_executor(None, ask, client)
        finally:
            await server.stop()

    return asyncio.run(main())


def both_calls(servicer: KVClusterServicer, req: Any) -> tuple[list[Any], Any]:
    """``req`` sent to a real grpc.aio server over ``servicer`` on loopback, once streamed
    (``Generate``: its messages) and once unary (``GenerateUnary``: its result)."""
    import grpc

    from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc
    from router.edge.servicer import start_server

    async def main() -> tuple[list[Any], Any]:
        server, port = await start_server(
            servicer, host="127.0.0.1", port=0, max_message_bytes=1 << 20
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.KVClusterStub(channel)
                streamed = [m async for m in stub.Generate(req, timeout=10)]
                unary = await stub.GenerateUnary(req, timeout=10)
            return streamed, unary
        finally:
            await server.stop(0)

    return asyncio.run(main())
