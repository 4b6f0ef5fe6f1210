"""The client holds a call's timeout itself: a call gRPC leaves open past its deadline (as
grpcio's retrying sync streams can after a server restart) is cancelled ``DEADLINE_GUARD_S``
later, and a call that ends in time disarms the guard. Against real servers: a call returns
or fails within its timeout plus that bound whether its server dies, dies and comes back
stalled on the same port, or stops."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from cluster import client as client_mod
from cluster.client import KVClusterClient, build_request
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from tests.cluster.stub_router import StubProcess, free_port


class _StuckCall(grpc.RpcError):
    """A streamed call that never yields until cancelled (its deadline ignored)."""

    def __init__(self, messages: int = 0) -> None:
        self.cancelled = threading.Event()
        self.messages = messages
        self.callbacks: list = []

    def cancel(self) -> bool:
        self.cancelled.set()
        return True

    def add_done_callback(self, fn) -> None:  # noqa: ANN001
        self.callbacks.append(fn)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def __iter__(self):  # noqa: ANN204
        for _ in range(self.messages):  # a call that answers in time, then ends
            yield pb.GenerateResponse()
        if self.messages:
            for fn in self.callbacks:
                fn(self)
            return
        self.cancelled.wait(30)
        raise self


def test_a_stream_left_open_past_its_deadline_is_cancelled(monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "DEADLINE_GUARD_S", 0.2)
    with KVClusterClient("127.0.0.1:1") as client:
        stuck = _StuckCall()
        monkeypatch.setattr(client.stub, "Generate", lambda *a, **k: stuck)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(client.stream(build_request("x"), timeout=0.3))
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert stuck.cancelled.is_set() and time.monotonic() - t0 < 20


def test_a_stream_that_ends_in_time_disarms_its_guard(monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "DEADLINE_GUARD_S", 0.0)
    with KVClusterClient("127.0.0.1:1") as client:
        done = _StuckCall(messages=2)
        monkeypatch.setattr(client.stub, "Generate", lambda *a, **k: done)
        assert len(list(client.stream(build_request("x"), timeout=0.2))) == 2
        time.sleep(0.4)  # past timeout + guard
        assert not done.cancelled.is_set()


class _EarlyDoneCall(_StuckCall):
    """A stuck call whose done callbacks run at once (as a retried call's can)."""

    def add_done_callback(self, fn) -> None:  # noqa: ANN001
        fn(self)


def test_a_done_callback_does_not_disarm_the_guard(monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "DEADLINE_GUARD_S", 0.2)
    with KVClusterClient("127.0.0.1:1") as client:
        stuck = _EarlyDoneCall()
        monkeypatch.setattr(client.stub, "Generate", lambda *a, **k: stuck)
        with pytest.raises(grpc.RpcError):
            list(client.stream(build_request("x"), timeout=0.3))
        assert stuck.cancelled.is_set()


# Real gRPC servers in their own processes (tests/cluster/stub_router.py), faulted as a
# router's node is: killed, killed and a stalling one started on the same port, stopped.
TIMEOUT_S = 1.5
BOUND_S = client_mod.DEADLINE_GUARD_S + 1.0  # the guard, and slack for a busy machine


@pytest.fixture
def stubs():
    procs: list[StubProcess] = []

    def start(port: int | None = None, mode: str = "serve") -> StubProcess:
        proc = StubProcess(port or free_port(), mode)
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        p.close()


def _timed(fn) -> tuple[grpc.StatusCode, float]:  # noqa: ANN001
    t0 = time.monotonic()
    try:
        fn()
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
    return code, time.monotonic() - t0


def _long() -> object:
    return build_request("x", max_tokens=10_000)  # 200 s of tokens: never ends in time


@pytest.mark.parametrize("fault", ["kill", "kill_restart_stalled", "stop"])
def test_a_stream_ends_in_time_whatever_its_server_does(stubs, fault: str) -> None:
    server = stubs()
    with KVClusterClient(server.address) as client:
        call = client.stream(_long(), timeout=TIMEOUT_S)
        t0 = time.monotonic()
        next(call)  # the stream is running
        if fault == "stop":
            server.stop()
        else:
            server.kill()
            if fault == "kill_restart_stalled":
                stubs(server.port, "stall")
        code, _ = _timed(lambda: list(call))
        assert code != grpc.StatusCode.OK
        assert time.monotonic() - t0 < TIMEOUT_S + BOUND_S


@pytest.mark.parametrize("fault", ["kill_restart_stalled", "stop"])
def test_calls_to_a_faulted_server_end_in_time(stubs, fault: str) -> None:
    """A call started after the fault: to a stalled server on the old port, or a stopped one."""
    server = stubs()
    with KVClusterClient(server.address) as client:
        assert client.generate("warm", max_tokens=1, timeout=10).completion_tokens == 0
        if fault == "stop":
            server.stop()
        else:
            server.kill()
            stubs(server.port, "stall")
        for call in (
            lambda: list(client.stream(_long(), timeout=TIMEOUT_S)),
            lambda: client.unary("x", timeout=TIMEOUT_S),
            lambda: client.generate("x", max_tokens=3, timeout=TIMEOUT_S),
        ):
            code, took = _timed(call)
            assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
            assert took < TIMEOUT_S + BOUND_S
