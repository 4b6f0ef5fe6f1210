"""The HTTP edge's own cost, and what a cheap-route flood takes from generation, in one run.

    .venv/bin/python -m benchmarks.http_edge            # light model, 256 streams; minutes
    .venv/bin/python -m benchmarks.http_edge --smoke    # tiny sizes, well under a minute

``parsers``: the router's HTTP server (``OpenAIServer``, real uvicorn, real sockets) over a
paced serving core in a process of its own (every ``--step-ms`` each open stream gets a
token, as from an engine step), ``--streams`` SSE streams from an aiohttp client here: the
server process's CPU per streamed token and per request, with uvicorn's h11 parser (pure
Python) against httptools (C). CPU time, not wall time: robust to a busy machine.

``flood``: a real cluster (one worker, the ``--model`` tiny model): ``--streams`` streams
alone, then beside ``--flood`` closed-loop keep-alive clients polling ``GET /health`` (a
process of their own), with the cheap routes gated (the default ``http_cheap_rate_per_s``)
and ungated (a rate no flood reaches; answers still shared): generation tok/s kept beside
the flood, and the probes answered per second; then the flood alone: the router's CPU per
probe and the share of a core the flood takes (CPU time, robust to a busy machine; the
tok/s figures are not). Table, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
from types import SimpleNamespace
from typing import Any

from benchmarks.common import emit_json, print_table

FLOODER = r"""
import asyncio, sys, time
port, conns = int(sys.argv[1]), int(sys.argv[2])
counts = {}
async def one(stop):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    while not stop.done():
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await r.readuntil(b"\r\n\r\n")
        n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await r.readexactly(n)
        status = head.split()[1].decode()
        counts[status] = counts.get(status, 0) + 1
        if b"connection: close" in head.lower():
            w.close()
            r, w = await asyncio.open_connection("127.0.0.1", port)
    w.close()
async def main():
    loop = asyncio.get_running_loop()
    stop = loop.run_in_executor(None, sys.stdin.read)  # until the benchmark closes stdin
    start = time.monotonic()
    await asyncio.gather(*(one(stop) for _ in range(conns)))
    print(f"{time.monotonic() - start:.3f}", *(f"{k}={v}" for k, v in sorted(counts.items())))
asyncio.run(main())
"""


def _paced_server(conn: Any, protocol: str, step_ms: float) -> None:
    """Child process: OpenAIServer over a core that gives every open stream a token each
    ``step_ms``; answers ``cpu`` with its CPU seconds, anything else stops it."""
    from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
    from router.http_api import OpenAIServer
    from router.placement.config import RequestLimits
    from router.placement.router_metrics import RouterMetrics
    from router.serving.core import ModelLimits
    from router.serving.edge_intake import Intake

    class Directory:
        async def candidates(self) -> dict:
            return {"w0": None}

        async def statuses(self) -> list:
            return []

    class Core:
        limits = ModelLimits("m", vocab_size=1000, max_model_len=4096, max_prompt_tokens=4095)
        directory = Directory()
        router = SimpleNamespace(metrics=RouterMetrics())
        retries = broken = 0

        def __init__(self) -> None:
            self.migrations: dict[str, int] = {}
            self.open: dict[str, asyncio.Queue] = {}
            self.engine: asyncio.Task | None = None

        def check_room(self) -> None:
            pass

        async def _steps(self) -> None:
            while True:
                await asyncio.sleep(step_ms / 1e3)
                for q in list(self.open.values()):
                    q.put_nowait(None)

        async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
            if self.engine is None:
                self.engine = asyncio.create_task(self._steps())
            q: asyncio.Queue = asyncio.Queue()
            self.open[request_id] = q
            try:
                for i in range(params.max_tokens):
                    await q.get()
                    last = i == params.max_tokens - 1
                    reason = FinishReason.LENGTH if last else None
                    d = CompletionDelta(0, " tok", [7], finish_reason=reason)
                    yield "w0", RequestOutput(request_id, [d], last, Usage(128, 0, i + 1))
            finally:
                del self.open[request_id]

    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1] * 8

        def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
            return "x" * len(ids)

    async def main() -> None:
        intake = Intake(Core(), Tokenizer(), auth=None, limits=RequestLimits())  # type: ignore[arg-type]
        server = OpenAIServer(
            intake,
            max_body_bytes=1 << 20,
            close_intake=True,
            http_protocol=protocol,  # type: ignore[arg-type]
        )
        conn.send(await server.start("127.0.0.1", 0))
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, conn.recv) == "cpu":
            conn.send(time.process_time())
        await server.stop()

    asyncio.run(main())


async def _sse(session: Any, url: str, max_tokens: int) -> int:
    body = {
        "model": "m",
        "prompt": [5] * 128,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            if raw.startswith(b"data: {") and b'"usage":{' in raw:
                tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
    return tokens


def _streams(url: str, n: int, max_tokens: int) -> int:
    import aiohttp

    async def run() -> int:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            return sum(await asyncio.gather(*(_sse(s, url, max_tokens) for _ in range(n))))

    return asyncio.run(run())


def _cpu_of(server: Any, url: str, n: int, max_tokens: int) -> float:
    """The server process's CPU seconds for ``n`` streams of ``max_tokens``."""
    server.send("cpu")
    c0 = server.recv()
    got = _streams(url, n, max_tokens)
    assert got == n * max_tokens, (got, n * max_tokens)
    server.send("cpu")
    return server.recv() - c0


def parsers(args: argparse.Namespace) -> list[dict]:
    """Server CPU per token and per request, h11 against httptools (best of --repeat)."""
    ctx = mp.get_context("spawn")
    rows = []
    for protocol in ("h11", "httptools"):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_paced_server, args=(there, protocol, args.step_ms))
        proc.start()
        url = f"http://127.0.0.1:{here.recv()}"
        _streams(url, 8, 2)  # warm-up

        n, k = args.streams, args.max_tokens
        per_token = min(_cpu_of(here, url, n, k) / (n * k) for _ in range(args.repeat))
        per_request = min(_cpu_of(here, url, n, 1) / n for _ in range(args.repeat))
        here.send("stop")
        proc.join(30)
        rows.append(
            {"parser": protocol, "cpu ms/tok": 1e3 * per_token, "cpu ms/req": 1e3 * per_request}
        )
    return rows


def flood(args: argparse.Namespace) -> list[dict]:
    """Generation tok/s alone and beside a /health flood, gated and ungated."""
    import ray

    from benchmarks.serving_path import cluster_config, engine_config, make_prompts
    from benchmarks.stream_clients import run_http
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster
    from worker.model.build_tiny import build_tiny_model
    from worker.model.config import ModelConfig

    model_dir = build_tiny_model(None, "llama", args.model, 0)
    args.vocab = ModelConfig.from_dir(model_dir).vocab_size
    rows = []
    gates = (("gated", None), ("ungated", 1e6))  # (the ungated one: a rate no flood reaches)
    for gate, rate in gates[: 1 if args.smoke else 2]:  # (the smoke: one cluster)
        base = cluster_config(
            f"http-edge-{os.getpid()}-{gate}",
            model_dir,
            1,
            engine_config(args.streams, args.prompt, args.max_tokens, 0),
        )
        data = base.model_dump()
        if rate is not None:
            data["router"]["http_cheap_rate_per_s"] = rate
        with Cluster(ClusterConfig.model_validate(data)) as cluster:
            h = next(iter(cluster.routers.values()))
            model = ray.get(h.__ray_call__.remote(lambda r: r.settings.model_id))
            url = cluster.http_endpoints[0]
            port = int(url.rsplit(":", 1)[1])
            run_http(url, model, make_prompts(8, args.prompt, args.vocab, 1), 4)
            alone = best_tok_s(url, model, args, seed=10)
            beside, probes = beside_flood(url, model, port, args)
            rows.append(
                {
                    "cheap routes": gate,
                    "alone tok/s": alone,
                    "beside flood tok/s": beside,
                    "kept": beside / alone,
                    **probes,
                    **flood_alone(cluster, port, args),
                }
            )
    return rows


def _flooder(port: int, conns: int) -> Any:
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", FLOODER, str(port), str(conns)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _counts(out: str) -> tuple[float, dict[str, int]]:
    seconds, *pairs = out.split()
    return float(seconds), {k: int(v) for k, v in (kv.split("=") for kv in pairs)}


def flood_alone(cluster: Any, port: int, args: argparse.Namespace) -> dict[str, float]:
    """The flood with no generation: the router's CPU per answered probe and the share of
    a core the flood takes (CPU time: robust to a busy machine, unlike tok/s)."""
    from benchmarks.serving_probes import router_cpu

    proc = _flooder(port, args.flood)
    time.sleep(0.5)
    c0, t0 = router_cpu(cluster), time.perf_counter()
    time.sleep(args.flood_alone_s)
    c1, t1 = router_cpu(cluster), time.perf_counter()
    out, _ = proc.communicate("", timeout=60)
    seconds, counts = _counts(out)
    rate = sum(counts.values()) / seconds
    return {
        "router cores (flood alone)": (c1 - c0) / (t1 - t0),
        "router cpu ms/probe": 1e3 * (c1 - c0) / max(1.0, rate * (t1 - t0)),
    }


def best_tok_s(url: str, model: str, args: argparse.Namespace, seed: int) -> float:
    from benchmarks.serving_path import make_prompts
    from benchmarks.stream_clients import run_http

    return max(
        run_http(
            url,
            model,
            make_prompts(args.streams, args.prompt, args.vocab, seed + i),
            args.max_tokens,
        ).tok_s
        for i in range(args.repeat)
    )


def beside_flood(
    url: str, model: str, port: int, args: argparse.Namespace
) -> tuple[float, dict[str, Any]]:
    from benchmarks.serving_path import make_prompts
    from benchmarks.stream_clients import run_http

    best, answered = 0.0, {}
    for i in range(args.repeat):
        proc = _flooder(port, args.flood)
        time.sleep(0.5)  # the flood is on
        prompts = make_prompts(args.streams, args.prompt, args.vocab, 50 + i)
        run = run_http(url, model, prompts, args.max_tokens)
        out, _ = proc.communicate("", timeout=60)  # the flood lasts as long as generation
        seconds, counts = _counts(out)
        if run.tok_s > best:
            best = run.tok_s
            answered = {
                "probes 200/s": counts.get("200", 0) / seconds,
                "probes 503/s": counts.get("503", 0) / seconds,
            }
    return best, answered


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=20.0, help="paced core's step")
    parser.add_argument("--model", default="light")
    parser.add_argument("--flood", type=int, default=32, help="flooding connections")
    parser.add_argument("--flood-alone-s", type=float, default=5.0, help="flood, no generation")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--skip-flood", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.streams, args.max_tokens, args.prompt, args.model = 8, 8, 16, "tiny"
        args.flood, args.repeat, args.flood_alone_s = 4, 1, 1.0
    rows = parsers(args)
    print_table(rows, f"HTTP server CPU, {args.streams} SSE streams x {args.max_tokens} tokens")
    h11, fast = rows
    head: dict = {
        "h11_cpu_ms_tok": round(h11["cpu ms/tok"], 4),
        "httptools_cpu_ms_tok": round(fast["cpu ms/tok"], 4),
        "h11_cpu_ms_req": round(h11["cpu ms/req"], 3),
        "httptools_cpu_ms_req": round(fast["cpu ms/req"], 3),
    }
    if not args.skip_flood:
        frows = flood(args)
        print_table(frows, f"generation beside {args.flood} connections polling /health")
        for r in frows:
            key = r["cheap routes"]
            head[f"flood_{key}_kept"] = round(r["kept"], 3)
            head[f"flood_{key}_probes_per_s"] = round(r.get("probes 200/s", 0.0), 1)
            head[f"flood_{key}_router_cores"] = round(r["router cores (flood alone)"], 3)
            head[f"flood_{key}_router_cpu_ms_probe"] = round(r["router cpu ms/probe"], 3)
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
