"""The gRPC edge closes connections that never complete their HTTP/2 handshake, and ones
that carry no call for a while (a GOAWAY: the client's channel reconnects on its next
call): grpc's defaults keep both for minutes or forever, and enough of them exhaust the
router's file descriptors (its HTTP edge's too). A real grpc.aio server on a fake core."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import router.edge.servicer as servicer_mod
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc
from router.edge.servicer import start_server
from tests.router.edges import grpc_servicer
from tests.router.serving.test_tokenize_limits import LIMITS, Core, SpyTokenizer


def test_silent_and_idle_connections_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicer_mod, "HANDSHAKE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(servicer_mod, "IDLE_S", 1.0)
    svc = grpc_servicer(Core(), SpyTokenizer(), limits=LIMITS)

    async def main() -> tuple[list[bytes], grpc.ChannelConnectivity, list[int]]:
        server, port = await start_server(svc, host="127.0.0.1", port=0, max_message_bytes=1 << 20)
        try:
            conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            conns[1][1].write(b"PRI * HTTP/2.0\r\n")  # half the connection preface
            silent = await asyncio.gather(
                *(asyncio.wait_for(r.read(), 10) for r, _ in conns)  # to the server's close
            )
            for _, w in conns:
                w.close()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.KVClusterStub(channel)
                first = await stub.Tokenize(pb.TokenizeRequest(text="abc"), timeout=10)
                await asyncio.sleep(2.5)  # no call under way for over IDLE_S
                idle = channel.get_state()
                second = await stub.Tokenize(pb.TokenizeRequest(text="abcd"), timeout=10)
            return silent, idle, [len(first.token_ids), len(second.token_ids)]
        finally:
            await server.stop(0)

    silent, idle, answered = asyncio.run(main())
    assert all(s.endswith(b"before handshake timeout") for s in silent), silent  # a GOAWAY
    assert idle == grpc.ChannelConnectivity.IDLE  # the server let it go
    assert answered == [3, 4]  # and the channel reconnected on its next call
