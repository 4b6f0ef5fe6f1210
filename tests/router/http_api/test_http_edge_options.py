"""CORS is off unless origins are configured, and then answers only those origins; unknown
request fields are accepted, logged once per name and counted (a real uvicorn server on a
small serving core, raw HTTP on loopback)."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.edges import http_server
from tests.router.http_api.test_http_hostile_bodies import Core, Tokenizer


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
    server = http_server(Core(), Tokenizer(), cors_origins=origins)

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
    assert "DELETE" in preflight["access-control-allow-methods"]  # (a kept response)
    assert "access-control-allow-origin" not in other


def test_unknown_fields_are_accepted_logged_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = http_server(Core(), Tokenizer())
    body = json.dumps({"prompt": "hi", "frobnicate": 1, "zz_new_sdk_field": None}).encode()

    def post(port: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        status = conn.getresponse().status
        conn.close()
        return status

    def scrape(port: int) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return text

    async def main() -> tuple[list[int], str]:
        port = await server.start("127.0.0.1", 0)
        try:
            loop = asyncio.get_running_loop()
            statuses = [await loop.run_in_executor(None, post, port) for _ in range(3)]
            return statuses, await loop.run_in_executor(None, scrape, port)
        finally:
            await server.stop()

    with caplog.at_level(logging.WARNING, logger="router.http_api.app"):
        statuses, text = asyncio.run(main())
    assert statuses == [200] * 3
    logged = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert sorted(logged) == sorted(
        f"ignoring unknown request field {n!r} (logged once per name)"
        for n in ("frobnicate", "zz_new_sdk_field")
    )
    (fam,) = [
        f for f in text_string_to_metric_families(text) if f.name == "kvc_http_unknown_fields"
    ]
    counts = {s.labels["field"]: s.value for s in fam.samples if s.name.endswith("_total")}
    assert counts == {"frobnicate": 3.0, "zz_new_sdk_field": 3.0}
