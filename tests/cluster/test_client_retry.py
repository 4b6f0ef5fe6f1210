"""The client retries a call that failed UNAVAILABLE before any answer, resumes a stream that
already delivered tokens (never replays it), and keeps gRPC's own retries off (real gRPC servers
on loopback)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from cluster.client import DEADLINE_GUARD_S, KVClusterClient, build_request
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc
from tests.cluster.stub_router import free_port


class Flaky(pb_grpc.KVClusterServicer):
    """Fails the first ``fail_first`` Generate calls UNAVAILABLE; ``after_token``: fail after
    streaming one token (7) instead of before. A call answers the tokens 7, 8, 9 after those it
    continues from, and records every request it got."""

    def __init__(self, fail_first: int, after_token: bool = False) -> None:
        self.fail_first = fail_first
        self.after_token = after_token
        self.requests: list[pb.GenerateRequest] = []

    @property
    def calls(self) -> int:
        return len(self.requests)

    def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        self.requests.append(request)
        if self.calls <= self.fail_first:
            if self.after_token:
                yield pb.GenerateResponse(token_ids=[7], text="7 ")
            context.abort(grpc.StatusCode.UNAVAILABLE, "no live worker")
        for t in (7, 8, 9)[len(request.continue_from) :]:
            yield pb.GenerateResponse(token_ids=[t], text=f"{t} ")
        yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP)


@pytest.fixture
def serve():
    servers = []

    def start(servicer: Flaky, port: int = 0) -> str:
        """``servicer`` on ``port`` (0: a free one); its address."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_KVClusterServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


def test_unavailable_before_any_answer_is_retried(serve) -> None:
    flaky = Flaky(fail_first=2)
    with KVClusterClient(serve(flaky)) as client:
        assert client.generate("echo", timeout=10).text == "7 8 9 "
    assert flaky.calls == 3


def test_retries_are_bounded_and_can_be_turned_off(serve) -> None:
    flaky = Flaky(fail_first=10)
    with KVClusterClient(serve(flaky), retries=2) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("echo", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.calls == 3
    flaky = Flaky(fail_first=1)
    with KVClusterClient(serve(flaky), retries=0) as client:
        with pytest.raises(grpc.RpcError):
            client.generate("echo", timeout=10)
    assert flaky.calls == 1


def test_a_stream_that_delivered_tokens_is_resumed_on_its_one_address_not_replayed(serve) -> None:
    """Its router died mid-stream and came back on the same port (or the address is a load
    balancer): the next attempt continues after the tokens the reader has."""
    flaky = Flaky(fail_first=1, after_token=True)
    with KVClusterClient(serve(flaky)) as client:
        out = client.generate("echo", timeout=10)
    assert out.token_ids[0] == [7, 8, 9] and out.text == "7 8 9 "
    assert [list(r.continue_from) for r in flaky.requests] == [[], [7]]


def test_a_stream_of_several_samples_is_not_resumed(serve) -> None:
    flaky = Flaky(fail_first=1, after_token=True)
    with KVClusterClient(serve(flaky)) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("echo", n=2, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.calls == 1


def test_retry_count_is_validated() -> None:
    with pytest.raises(ValueError, match=r"retries must be in \[0, 16\], got -1"):
        KVClusterClient("127.0.0.1:1", retries=-1)


def test_calls_to_a_refusing_port_end_in_time_and_leave_the_channel_usable(serve) -> None:
    """Short calls to an address nothing listens on, each failing UNAVAILABLE at once. With
    gRPC's retry policy on (a millisecond's back-off), its retry filter wedged this channel
    within these calls (grpc/grpc#41036: a retry's timer races the call's deadline; a wedged
    call ignores its deadline and cancel(), later calls on the channel hang or time out while
    the server answers). The client keeps gRPC's retries off and retries itself: every call
    ends within its timeout plus the guard, and the channel serves once a server listens."""
    port = free_port()
    with KVClusterClient(f"127.0.0.1:{port}", retries=4) as client:
        for i in range(300):
            timeout = 0.002 * (1 + i % 20)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(client.stream(build_request("x"), timeout=timeout))
            assert err.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            took = time.monotonic() - t0
            assert took < timeout + DEADLINE_GUARD_S, f"call {i} outlived its deadline"
        serve(Flaky(fail_first=0), port)
        assert client.generate("echo", timeout=10).text == "7 8 9 "
