"""The OpenAI HTTP API of a TLS cluster with auth: HTTPS with the same certificate, and the
same bearer tokens as gRPC."""

from __future__ import annotations

import http.client
import json
import ssl
from urllib.parse import urlsplit

import pytest

from tests.reliability.guard.conftest import TOKENS

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def get(secure, tls, path: str, token: str | None) -> tuple[int, dict]:  # noqa: ANN001
    u = urlsplit(secure.http_endpoints[0])
    ctx = ssl.create_default_context(cafile=str(tls.ca))
    conn = http.client.HTTPSConnection(u.hostname, u.port, context=ctx, timeout=30)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_https_with_the_cluster_certificate_and_tokens(secure, tls) -> None:  # noqa: ANN001
    assert secure.http_endpoints[0].startswith("https://")
    status, body = get(secure, tls, "/v1/models", TOKENS["alice"])
    assert status == 200 and body["data"][0]["id"] == secure.model_id
    status, body = get(secure, tls, "/v1/models", "not-a-token")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, _ = get(secure, tls, "/health", None)  # probes carry no token
    assert status == 200
    with pytest.raises(ssl.SSLError):  # a client that does not trust the cluster's CA
        u = urlsplit(secure.http_endpoints[0])
        conn = http.client.HTTPSConnection(
            u.hostname, u.port, timeout=30, context=ssl.create_default_context()
        )
        conn.request("GET", "/health")
