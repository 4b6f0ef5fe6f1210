"""The client retries a call that failed UNAVAILABLE before any answer, and never a stream
that already delivered tokens (real gRPC server on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from cluster.client import KVClusterClient, retry_service_config
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc


class Flaky(pb_grpc.KVClusterServicer):
    """Fails the first ``fail_first`` Generate calls UNAVAILABLE; ``after_token``: fail after
    streaming one message instead of before."""

    def __init__(self, fail_first: int, after_token: bool = False) -> None:
        self.fail_first = fail_first
        self.after_token = after_token
        self.calls = 0

    def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        self.calls += 1
        if self.calls <= self.fail_first:
            if self.after_token:
                yield pb.GenerateResponse(text="partial")
            context.abort(grpc.StatusCode.UNAVAILABLE, "no live worker")
        yield pb.GenerateResponse(text=request.text, finish_reason=pb.FINISH_REASON_STOP)


@pytest.fixture
def serve():
    servers = []

    def start(servicer: Flaky) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_KVClusterServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


def test_unavailable_before_any_answer_is_retried(serve) -> None:
    flaky = Flaky(fail_first=2)
    with KVClusterClient(serve(flaky)) as client:
        assert client.generate("echo", timeout=10).text == "echo"
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


def test_a_stream_that_delivered_tokens_is_not_replayed(serve) -> None:
    flaky = Flaky(fail_first=1, after_token=True)
    with KVClusterClient(serve(flaky)) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("echo", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.calls == 1


def test_retry_count_is_validated() -> None:
    with pytest.raises(ValueError, match="retries must be in"):
        retry_service_config(5)
