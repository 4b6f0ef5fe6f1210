"""The HTTP edge closes connections that send no request, or trickle its head or body:
uvicorn alone waits on them forever, and enough of them exhaust the router's file
descriptors (its gRPC server's too). A real uvicorn server on a fake serving core."""

from __future__ import annotations

import asyncio
import json

import pytest

import router.http_api.app as app_mod
from router.http_api import OpenAIServer
from tests.router.test_tokenize_limits import LIMITS, Core, SpyTokenizer


async def _read_until_closed(reader: asyncio.StreamReader, limit_s: float) -> bytes:
    return await asyncio.wait_for(reader.read(), limit_s)


def test_idle_trickling_and_slow_body_connections_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(app_mod, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(app_mod, "BODY_TIMEOUT_S", 0.5)
    server = OpenAIServer(
        Core(),  # type: ignore[arg-type]
        SpyTokenizer(),  # type: ignore[arg-type]
        auth=None,
        limits=LIMITS,
        max_body_bytes=1 << 20,
    )

    async def main() -> list[bytes]:
        port = await server.start("127.0.0.1", 0)
        heads = [
            b"",  # connects, sends nothing
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # half a head
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
        ]
        try:
            conns = [await asyncio.open_connection("127.0.0.1", port) for _ in heads]
            for (_, w), head in zip(conns, heads, strict=True):
                w.write(head)
                await w.drain()
            answers = await asyncio.gather(*(_read_until_closed(r, 10) for r, _ in conns))
            for _, w in conns:
                w.close()
            # the server still answers a prompt client
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n")
            answers.append(await asyncio.wait_for(r.readline(), 10))
            w.close()
            return answers
        finally:
            await server.stop()

    idle, half_head, slow_body, fresh = asyncio.run(main())
    assert idle == b"" and half_head == b""  # closed without an answer
    head, _, body = slow_body.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert "not received within 0.5 s" in json.loads(body)["error"]["message"]
    assert fresh.startswith(b"HTTP/1.1 404")
