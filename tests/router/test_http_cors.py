"""CORS is off unless origins are configured, and then answers only those origins (a real
uvicorn server on a small serving core, raw HTTP on loopback)."""

from __future__ import annotations

import asyncio
import http.client

from router.http_api import OpenAIServer
from router.placement.config import RequestLimits
from tests.router.test_http_hostile_bodies import Core, Tokenizer


def _ask(port: int, method: str, origin: str) -> dict[str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        conn.request(method, "/v1/models", headers=headers)
        resp = conn.getresponse()
        resp.read()
        return {k.lower(): v for k, v in resp.getheaders()} | {"status": str(resp.status)}
    finally:
        conn.close()


def _answers(origins: tuple[str, ...]) -> list[dict[str, str]]:
    server = OpenAIServer(
        Core(),  # type: ignore[arg-type]
        Tokenizer(),  # type: ignore[arg-type]
        auth=None,
        limits=RequestLimits(),
        max_body_bytes=1 << 20,
        cors_origins=origins,
    )

    async def main() -> list[dict[str, str]]:
        port = await server.start("127.0.0.1", 0)
        try:
            loop = asyncio.get_running_loop()
            return [
                await loop.run_in_executor(None, _ask, port, method, origin)
                for method, origin in (
                    ("GET", "https://app.example"),
                    ("OPTIONS", "https://app.example"),
                    ("GET", "https://evil.example"),
                )
            ]
        finally:
            await server.stop()

    return asyncio.run(main())


def test_cors_is_off_by_default() -> None:
    for answer in _answers(()):
        assert "access-control-allow-origin" not in answer


def test_cors_answers_configured_origins_only() -> None:
    get, preflight, other = _answers(("https://app.example",))
    assert get["status"] == "200" and get["access-control-allow-origin"] == "https://app.example"
    assert preflight["status"] == "200" and "POST" in preflight["access-control-allow-methods"]
    assert "access-control-allow-origin" not in other
