"""The HTTP edge closes connections that send no request, or trickle its head or body:
uvicorn alone waits on them forever, and enough of them exhaust the router's file
descriptors (its gRPC server's too). A real uvicorn server on a fake serving core."""

from __future__ import annotations

import asyncio
import json

import pytest

import router.http_api.app as app_mod
from tests.router.edges import http_server
from tests.router.serving.test_tokenize_limits import LIMITS, Core, SpyTokenizer


async def _read_until_closed(reader: asyncio.StreamReader, limit_s: float) -> bytes:
    return await asyncio.wait_for(reader.read(), limit_s)


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_idle_trickling_and_slow_body_connections_are_closed(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app_mod, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(app_mod, "BODY_TIMEOUT_S", 0.5)
    server = http_server(Core(), SpyTokenizer(), limits=LIMITS, http_protocol=protocol)

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


def test_bodies_held_at_once_are_bounded_for_all_requests_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each body is bounded, yet a few hundred slow uploads of large ones held gigabytes (200
    stalled 4 MB uploads: +1 GB of router memory for up to BODY_TIMEOUT_S). Past the budget
    for all requests together, a body is refused (503, Retry-After); the budget comes back
    as bodies end, however they end."""
    monkeypatch.setattr(app_mod, "BODY_BUDGET_BYTES", 1 << 20)
    # the budget: max(1 MiB, 4 x 200 KiB) = 1 MiB
    server = http_server(Core(), SpyTokenizer(), limits=LIMITS, max_body_bytes=200 << 10)
    part = b"x" * (190 << 10)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (200 << 10)

    async def main() -> tuple[list[int], bytes, int, bytes]:
        port = await server.start("127.0.0.1", 0)
        try:
            stalled = []
            for _ in range(5):  # 5 x 190 KiB held: 950 KiB of the 1 MiB
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(head + part)
                await w.drain()
                stalled.append((r, w))
            while server.bodies.held < 5 * len(part):
                await asyncio.sleep(0.01)
            held = [server.bodies.held]
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(head + part)  # the sixth would pass the budget
            refused = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
            length = int(refused.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            refused += await asyncio.wait_for(r.readexactly(length), 10)
            w.close()
            for _, w in stalled:  # clients gone mid-body: their bytes are given back
                w.close()
            while server.bodies.held:
                await asyncio.sleep(0.01)
            held.append(server.bodies.held)
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            fresh = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
            w.close()
            return held, refused, server.bodies.held, fresh
        finally:
            await server.stop()

    held, refused, after, fresh = asyncio.run(main())
    assert held == [5 * len(part), 0] and after == 0
    head_, _, body = refused.partition(b"\r\n\r\n")
    assert head_.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head_.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "server_busy" and "all requests together" in err["message"], err
    assert fresh.startswith(b"HTTP/1.1 400")  # served again: {} has no prompt
