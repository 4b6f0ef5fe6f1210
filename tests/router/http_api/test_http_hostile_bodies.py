"""Hostile bodies cannot stall the router's event loop (which its gRPC server shares): a
real uvicorn server on a small serving core, raw clients on loopback sending deep, wide and
huge JSON, while a small request is timed and the loop's own lag is watched."""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
import time
from types import SimpleNamespace

from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from router.placement.router_metrics import RouterMetrics
from router.serving.core import ModelLimits
from tests.router.edges import http_server

MAX_BODY = 4 << 20


class Directory:
    async def candidates(self) -> dict:
        return {}

    async def statuses(self) -> list:
        return []


class Core:
    """A serving core that answers every prompt with one token at once."""

    limits = ModelLimits("m", vocab_size=100, max_model_len=512, max_prompt_tokens=511)
    directory = Directory()
    router = SimpleNamespace(metrics=RouterMetrics())  # what /metrics reads of it
    retries = broken = 0
    migrations: dict[str, int] = {}  # noqa: RUF012 (never written)

    def check_room(self) -> None:  # queues never full
        pass

    async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
        d = CompletionDelta(0, "x", [7], finish_reason=FinishReason.LENGTH)
        yield "w0", RequestOutput(request_id, [d], True, Usage(len(token_ids), 0, 1))


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * min(len(text), 8)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "x" * len(ids)


HOSTILE = r"""
import http.client, sys
from concurrent.futures import ThreadPoolExecutor

# one escaped emoji (a surrogate pair) and 600,000 empty lists nested 500 deep
nested = (
    b'{"prompt": "\\ud83d\\ude00", "a": '
    + b"[" * 500 + b",".join([b"[]"] * 600_000) + b"]" * 500 + b"}"
)
ids = b'{"prompt": [' + b",".join([b"1"] * 1_950_000) + b"]}"  # 3.9 MB of token ids
deep = b'{"prompt": "x", "a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
surrogate = b'{"prompt": "\xed\xa0\x80", "stop": ["\xed\xa0\x80"]}'

def post(body):
    conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return resp.status

print("ready", flush=True)
while sys.stdin.readline():  # one flood per line
    with ThreadPoolExecutor(9) as pool:
        print(*pool.map(post, [nested, deep, surrogate] + [ids] * 6), flush=True)
"""


def post(port: int, body: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - start
    finally:
        conn.close()


FLOODS = 4  # floods sent at most, until one is calm


def calm(added: float, control: float, statuses: list[int], small_times: list[float]) -> bool:
    """The loop's worst lag in the flood is under 50 ms over the control period's, and no
    small request took 0.5 s longer than that."""
    return added < 0.05 and bool(small_times) and max(small_times) < 0.5 + control


def test_hostile_bodies_do_not_stall_the_event_loop() -> None:
    server = http_server(Core(), Tokenizer(), max_body_bytes=MAX_BODY)
    small = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()

    async def main() -> list[tuple[float, float, list[int], list[float]]]:
        port = await server.start("127.0.0.1", 0)
        # the hostile client is a process of its own: its work is not the server's
        client = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            HOSTILE,
            str(port),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert client.stdin is not None and client.stdout is not None
        assert await client.stdout.readline() == b"ready\n"  # its bodies are built
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        lags: list[float] = []

        finished = threading.Event()

        async def watch() -> None:  # the loop's lag: how late a 5 ms sleep wakes up
            while not finished.is_set():
                t = loop.time()
                await asyncio.sleep(0.005)
                lags.append(loop.time() - t - 0.005)

        def small_requests() -> list[float]:
            times = []
            while not stop.is_set():
                status, took = post(port, small)
                assert status == 200
                times.append(took)
                time.sleep(0.01)
            return times

        watcher = asyncio.create_task(watch())
        floods: list[tuple[float, float, list[int], list[float]]] = []
        try:
            # each flood follows a control period of small requests alone: the machine's
            # own jitter (other processes), measured the same way, is not the bodies' doing;
            # floods are sent until one is calm, FLOODS at most (a stall of ours shows in
            # every one, a busy machine's in some)
            for _ in range(FLOODS):
                stop.clear()
                smalls = loop.run_in_executor(None, small_requests)
                await asyncio.sleep(1.0)
                control, lags[:] = max(lags), []
                client.stdin.write(b"go\n")
                answer = await asyncio.wait_for(client.stdout.readline(), 120)
                worst = max(lags)
                stop.set()
                times = await smalls
                floods.append((worst - control, control, [int(x) for x in answer.split()], times))
                lags[:] = []
                if calm(*floods[-1]):
                    break
        finally:
            stop.set()
            finished.set()
            await watcher
            if client.returncode is None:
                client.kill()
            await client.wait()
            await server.stop()
        return floods

    floods = asyncio.run(main())
    for _, _, statuses, small_times in floods:
        assert statuses == [413, 413, 400] + [413] * 6, statuses
        assert small_times, "no small request was served meanwhile"
    added, control, _, small_times = floods[-1]
    assert added < 0.05, f"event loop stalled {added * 1000:.0f} ms over {control * 1000:.0f} idle"
    assert max(small_times) < 0.5 + control, small_times  # served throughout the flood
