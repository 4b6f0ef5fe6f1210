"""The client holds a streamed call's timeout itself: a call gRPC leaves open past its
deadline (as grpcio's retrying sync streams can after a server restart) is cancelled
``DEADLINE_GUARD_S`` later, and a call that ends in time disarms the guard."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from cluster import client as client_mod
from cluster.client import KVClusterClient, build_request


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
            yield None
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
