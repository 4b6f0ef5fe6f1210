"""``kvcluster bench --api http``: the bench's timed request over the OpenAI HTTP API.

The same workload and the same :class:`benchmarks.loadgen.Sample` as over gRPC: a greedy
streamed ``/v1/completions`` request (SSE with ``include_usage``), TTFT at the first chunk
that carries a choice, the worker from the ``x-kvcluster-worker`` header.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import time
from urllib.parse import urlsplit

from benchmarks.loadgen import Sample


class OpenAIBenchClient:
    """A client of one router's OpenAI API (``http(s)://host:port``); thread-safe (one
    connection per request). ``token``: the bearer token (default: ``OPENAI_API_KEY``, as
    OpenAI clients and load generators read it)."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 300) -> None:
        u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname or "127.0.0.1", u.port or (443 if self.https else 80)
        self.headers = {"Content-Type": "application/json"}
        token = token or os.environ.get("OPENAI_API_KEY")
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.timeout_s = timeout_s
        self.model = self._get("/v1/models")["data"][0]["id"]

    def _conn(self) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout_s, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def _get(self, path: str) -> dict:
        conn = self._conn()
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            body = json.loads(resp.read())
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: {resp.status} {body}")
            return body
        finally:
            conn.close()

    def close(self) -> None:
        pass

    def __enter__(self) -> OpenAIBenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def one_http_request(client: OpenAIBenchClient, prompt: str, max_tokens: int) -> Sample:
    """Stream one greedy completion; an HTTP error becomes a failed sample, never raises."""
    body = {
        "model": client.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = float("nan")
    usage: dict = {}
    worker = ""
    code = "OK"
    conn = client._conn()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=client.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            code = f"HTTP_{resp.status}"
        else:
            worker = resp.getheader("x-kvcluster-worker", "")
            for line in resp:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    code = f"STREAM_{chunk['error'].get('type', 'error')}"
                elif chunk.get("choices") and ttft != ttft:
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (OSError, http.client.HTTPException, ValueError) as exc:
        code = type(exc).__name__
    finally:
        conn.close()
    return Sample(
        code == "OK",
        code,
        time.perf_counter() - t0,
        ttft,
        worker,
        usage.get("prompt_tokens", 0),
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        usage.get("completion_tokens", 0),
    )
