"""Streaming clients of ``benchmarks/serving_path.py``: many streams at once from one asyncio
loop, over SSE (``/v1/completions``, aiohttp) or gRPC (``grpc.aio``). Each stream's tokens
are counted from what the server reports (the final usage over HTTP, the token ids over
gRPC); the messages (SSE events / gRPC responses) are counted too, which shows coalescing."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
import grpc

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc


@dataclass
class StreamRun:
    wall_s: float  # first request sent .. last stream ended
    tokens: int  # completion tokens over all streams
    messages: int  # SSE events / gRPC messages carrying tokens
    per_stream: list[int]  # completion tokens of each stream, in prompt order

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


async def _sse_one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[int, int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = events = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                events += 1
            usage = chunk.get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return tokens, events


async def _http(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> StreamRun:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_sse_one(session, url, model, p, max_tokens) for p in prompts)
        )
        wall = time.perf_counter() - start
    return StreamRun(
        wall, sum(t for t, _ in results), sum(e for _, e in results), [t for t, _ in results]
    )


def run_http(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> StreamRun:
    """Every prompt as one SSE stream, all at once."""
    return asyncio.run(_http(url, model, prompts, max_tokens))


async def _grpc_one(
    stub: pb_grpc.KVClusterStub, prompt: list[int], max_tokens: int
) -> tuple[int, int]:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        params=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        stream_text=False,
    )
    tokens = messages = 0
    async for msg in stub.Generate(req, timeout=600):
        if msg.token_ids:
            messages += 1
            tokens += len(msg.token_ids)
    return tokens, messages


async def _grpc(endpoint: str, prompts: list[list[int]], max_tokens: int) -> StreamRun:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.KVClusterStub(channel)
        start = time.perf_counter()
        results = await asyncio.gather(*(_grpc_one(stub, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - start
    return StreamRun(
        wall, sum(t for t, _ in results), sum(m for _, m in results), [t for t, _ in results]
    )


def run_grpc(endpoint: str, prompts: list[list[int]], max_tokens: int) -> StreamRun:
    """Every prompt as one gRPC server stream, all at once, on one channel."""
    return asyncio.run(_grpc(endpoint, prompts, max_tokens))
