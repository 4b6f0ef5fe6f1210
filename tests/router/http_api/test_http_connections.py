"""The HTTP connection bounds, on a real uvicorn server over a small serving core: the head
deadlines and the head size under both parsers (httptools, h11), the connection cap answered
the OpenAI way (the ``openai`` client sees a 503 ``server_busy`` with Retry-After), and the
cheap routes' gate and shared answers (a flood of them costs one fleet read, and past the
gate's wait they are refused while generation is served)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

import router.http_api.app as app_mod
from router.http_api import OpenAIServer
from router.http_api.probe_gate import ProbeGate
from router.serving.request_errors import ServerBusy
from tests.router.edges import http_server
from tests.router.http_api.test_http_hostile_bodies import Core, Directory, Tokenizer


def _server(core: Core | None = None, **kw: object) -> OpenAIServer:
    return http_server(core or Core(), Tokenizer(), **kw)


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict]:
    """One answer with a content-length: its head and JSON body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head, json.loads(await asyncio.wait_for(reader.readexactly(length), 10))


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_head_deadline_and_head_size_hold_under_both_parsers(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app_mod, "HEAD_TIMEOUT_S", 0.5)
    server = _server(http_protocol=protocol)

    async def main() -> tuple[bytes, bytes, bytes, bytes]:
        port = await server.start("127.0.0.1", 0)
        try:
            idle = await asyncio.open_connection("127.0.0.1", port)
            half = await asyncio.open_connection("127.0.0.1", port)
            half[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its head
            huge = await asyncio.open_connection("127.0.0.1", port)
            # one write, read whole by the server: its answer is not lost to a reset
            huge[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 << 10))
            closed = [await asyncio.wait_for(r.read(), 10) for r, _ in (idle, half, huge)]
            # one that goes on sending: cut off (a reset, its unread bytes) long before 1 GiB
            _, flooder = await asyncio.open_connection("127.0.0.1", port)
            flooder.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            sent = 0
            with pytest.raises(ConnectionError):
                for _ in range(1 << 14):
                    flooder.write(b"a" * (64 << 10))
                    await asyncio.wait_for(flooder.drain(), 10)
                    sent += 64 << 10
            assert sent < 64 << 20, sent
            for _, w in (idle, half, huge):
                w.close()
            flooder.close()
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            fresh = await asyncio.wait_for(r.readline(), 10)
            w.close()
            return closed[0], closed[1], closed[2], fresh
        finally:
            await server.stop()

    idle, half, huge, fresh = asyncio.run(main())
    assert idle == b"" and half == b""  # closed at the deadline, unanswered
    status = huge.split(b"\r\n", 1)[0]  # refused long before 1 MiB was held
    assert status == (
        b"HTTP/1.1 431 Request Header Fields Too Large"
        if protocol == "httptools"
        else b"HTTP/1.1 400 Bad Request"
    ), huge[:200]
    if protocol == "httptools":
        body = json.loads(huge.partition(b"\r\n\r\n")[2])
        assert "over 16384 bytes" in body["error"]["message"]
    assert fresh.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("protocol", ["httptools", "h11"])
def test_connections_past_the_cap_get_an_openai_503_then_close(protocol: str) -> None:
    server = _server(max_connections=2, http_protocol=protocol)

    async def main() -> tuple[object, object, object, str]:
        port = await server.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            client = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
            try:
                await client.completions.create(model="m", prompt="hi", max_tokens=1)
            except openai.APIStatusError as exc:
                refused = exc
            # a raw one: the answer comes after the body, and then the connection closes
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            raw = await asyncio.wait_for(r.read(), 10)
            w.close()
            held[0][1].close()  # one leaves: a new connection is served
            await asyncio.sleep(0.1)
            ok = await client.completions.create(model="m", prompt="hi", max_tokens=1)
            await client.close()
            for _, w in held[1:]:
                w.close()
            return refused, raw, ok, server.intake.metrics.render([]).decode()
        finally:
            await server.stop()

    refused, raw, ok, metrics = asyncio.run(main())
    # both answers are counted with the other refusals of the error table
    assert 'kvc_request_errors_total{status="503"} 2.0' in metrics
    assert isinstance(refused, openai.APIStatusError) and refused.status_code == 503
    assert refused.response.headers["retry-after"] == "1"
    err = refused.body if isinstance(refused.body, dict) else {}
    assert err.get("code") == "server_busy" and "http_max_connections" in err["message"], err
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["type"] == "service_unavailable"
    assert ok.choices[0].text == "x"  # type: ignore[attr-defined]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_cheap_gate_admits_the_rate_queues_a_bounded_wait_and_refuses_the_rest() -> None:
    clock = _Clock()
    gate = ProbeGate(2.0, 3, clock=clock)  # a bucket of 2, 3 may wait

    async def main() -> tuple[list[str], int]:
        async def one() -> str:
            try:
                await gate.admit()
                return "served"
            except ServerBusy:
                return "busy"

        tasks = [asyncio.create_task(one()) for _ in range(10)]
        await asyncio.sleep(0.01)
        waiting = gate.waiting  # (their sleeps end by the real clock: 0.5 s, 1 s, 1.5 s)
        return [t.result() if t.done() else "waiting" for t in tasks], waiting

    states, waiting = asyncio.run(main())
    assert states == ["served"] * 2 + ["waiting"] * 3 + ["busy"] * 5 and waiting == 3
    assert gate.refused == 5


class _CountingDirectory(Directory):
    def __init__(self) -> None:
        self.calls = 0

    async def candidates(self) -> dict:
        self.calls += 1
        await asyncio.sleep(0.05)  # a fleet read takes a while: callers pile up on it
        return {"w0": None, "w1": None}


def test_a_cheap_route_flood_shares_one_answer_and_is_bounded_beside_generation() -> None:
    core = Core()
    core.directory = _CountingDirectory()  # type: ignore[assignment]
    shared = _server(core)
    other = Core()
    other.directory = _CountingDirectory()  # type: ignore[assignment]
    gated = _server(other, cheap_rate_per_s=0.001, cheap_max_waiting=2)  # a bucket of 1

    async def get(port: int, path: str) -> tuple[int, dict, dict]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head, body = await _answer(r)
        w.close()
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        return int(lines[0].split()[1]), headers, body

    async def main() -> tuple[list, int, list, list[bool], int]:
        port = await shared.start("127.0.0.1", 0)
        try:
            flood = await asyncio.gather(*(get(port, "/health") for _ in range(50)))
        finally:
            await shared.stop()
        port = await gated.start("127.0.0.1", 0)
        try:
            probes = [asyncio.create_task(get(port, "/health")) for _ in range(6)]
            await asyncio.sleep(0.3)
            done = [p.done() for p in probes]
            answered = [p.result() for p in probes if p.done()]
            answered.append(await get(port, "/no/such/path"))  # a wrong path is as cheap
            # generation passes no gate: served while two probes wait their turn
            r, w = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"prompt": "hi", "max_tokens": 1}'
            w.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                % len(body)
                + body
            )
            gen_head, gen = await _answer(r)
            w.close()
            for p in probes:
                p.cancel()
            return flood, core.directory.calls, answered, done, int(gen_head.split()[1])  # type: ignore[attr-defined]
        finally:
            await gated.stop()

    flood, reads, answered, done, gen_status = asyncio.run(main())
    assert [s for s, _, _ in flood] == [200] * 50
    assert {b["live_workers"] for _, _, b in flood} == {2}
    assert reads == 1  # fifty probes, one fleet read
    assert done.count(False) == 2  # the bounded wait
    statuses = sorted(s for s, _, _ in answered)
    assert statuses == [200, 503, 503, 503, 503]  # the bucket's one, then refusals
    for status, headers, body in answered:
        if status == 503:
            assert headers["retry-after"] == "1" and body["error"]["code"] == "server_busy"
    assert gen_status == 200


def test_a_waiting_cheap_request_whose_client_leaves_is_dropped_and_gives_its_place_back() -> None:
    core = Core()
    core.directory = _CountingDirectory()  # type: ignore[assignment]
    server = _server(core, cheap_rate_per_s=0.5, cheap_max_waiting=4)  # a bucket of 1, 2 s

    async def main() -> tuple[int, int, int, bool]:
        port = await server.start("127.0.0.1", 0)
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # takes the bucket's one
            await _answer(r)
            w.close()
            reads = core.directory.calls  # type: ignore[attr-defined]
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # waits its turn (2 s)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if server.probe_gate.waiting:
                    break
            waiting = server.probe_gate.waiting
            w.close()  # the client leaves before its turn
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not server.probe_gate.waiting:
                    break
            await asyncio.sleep(2.5)  # past the turn it had: it is never served
            calls = core.directory.calls - reads  # type: ignore[attr-defined]
            return waiting, server.probe_gate.waiting, calls, server.probe_gate.admit_now()
        finally:
            await server.stop()

    waiting, after, reads, next_served = asyncio.run(main())
    assert (waiting, after, reads) == (1, 0, 0)
    assert next_served  # its token came back: the next caller is served at once


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_accepted_connections_have_nagle_off(loop: str) -> None:
    """With Nagle on, an answer's second write (the body after the head, every SSE event
    after the first) waited for the client's delayed ACK: 40 ms a request on loopback. On
    both loops: the router actor's is uvloop's, a test process's asyncio's."""
    import socket

    import uvloop

    server = _server()

    async def main() -> list[int]:
        port = await server.start("127.0.0.1", 0)
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            await _answer(r)
            assert server._server is not None
            conns = server._server.server_state.connections
            flags = [
                c.transport.get_extra_info("socket").getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY
                )
                for c in conns
            ]
            w.close()
            return flags
        finally:
            await server.stop()

    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        flags = runner.run(main())
    assert len(flags) == 1 and flags[0] != 0
