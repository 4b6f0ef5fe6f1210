"""One streamed Generate call as the client's caller sees it: its deadline held by the client,
its attempts moved to the next router address while nothing has been delivered."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc

from cluster.deadline_watch import DeadlineWatch
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc


class ClientStream:
    """An iterator of the call's ``GenerateResponse`` messages, with ``cancel()``.

    Attempt ``i`` goes to ``stubs[(start + i) % len(stubs)]``. An attempt that fails
    ``UNAVAILABLE`` before its first message did nothing (its router was gone or had no live
    worker), so the next attempt is made, up to ``attempts`` in all, while time is left. One
    that fails ``UNAVAILABLE`` after delivering tokens (its router died mid-stream) is
    resumed, never replayed: the next attempt carries the tokens received
    (``continue_from``) and the router continues after them, so the reader sees no gap and
    no duplicate; a request of several sequences (``n > 1``, beams) or with a grammar is not
    resumed (its error is raised). With ``timeout``, each attempt gets what is left of it, and
    the call still open ``guard_s`` past it is cancelled by the watch, whatever gRPC's own
    deadline did: the reader then gets ``CANCELLED``. The guard is disarmed only when the
    reader sees the stream end, never by a gRPC callback."""

    def __init__(
        self,
        stubs: Sequence[pb_grpc.KVClusterStub],
        start: int,
        request: pb.GenerateRequest,
        *,
        timeout: float | None,
        metadata: list[tuple[str, str]],
        attempts: int,
        backoff_s: Callable[[int], float],
        watch: DeadlineWatch,
        guard_s: float,
        on_failover: Callable[[], None] = lambda: None,
    ) -> None:
        assert stubs and attempts >= 1
        self._stubs = stubs
        self._start = start
        self._request = request
        self._metadata = metadata
        self._attempts_left = attempts
        self._backoff_s = backoff_s
        self._on_failover = on_failover  # told when an attempt found its router unavailable
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._tried = 0  # attempts made
        self._delivered = False  # a message reached the reader: resumed, never replayed
        self._received: list[int] = []  # output tokens delivered (sequence 0)
        p = request.params
        self._resumable = p.n <= 1 and p.beam_width <= 1 and not p.HasField("structured")
        self._cancelled = False
        self._ended = False
        self._call = self._attempt()
        self._messages = iter(self._call)
        self._watch = watch
        self._guard = (
            None
            if self._deadline is None
            else watch.arm(self._deadline + guard_s, self._cancel_current)
        )

    @property
    def call(self) -> grpc.Call:
        """The attempt in progress (or the last one)."""
        return self._call

    def _attempt(self) -> grpc.Call:
        stub = self._stubs[(self._start + self._tried) % len(self._stubs)]
        self._tried += 1
        self._attempts_left -= 1
        remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        request = self._request
        if self._received:
            request = pb.GenerateRequest()
            request.CopyFrom(self._request)
            request.continue_from[:] = self._received
        return stub.Generate(request, timeout=remaining, metadata=self._metadata)

    def _cancel_current(self) -> None:
        self._call.cancel()

    def _end(self) -> None:
        self._ended = True
        if self._guard is not None:
            self._watch.disarm(self._guard)

    def _may_retry(self, exc: grpc.RpcError) -> bool:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._on_failover()
        if self._cancelled or self._attempts_left <= 0:
            return False
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        if self._delivered and not (self._resumable and self._received):
            return False
        pause = self._backoff_s(self._tried)
        if self._deadline is not None and time.monotonic() + pause >= self._deadline:
            return False
        time.sleep(pause)
        return True

    def __iter__(self) -> ClientStream:
        return self

    def __next__(self) -> pb.GenerateResponse:
        if self._ended:
            raise StopIteration
        while True:
            try:
                msg = next(self._messages)
            except StopIteration:
                self._end()
                raise
            except grpc.RpcError as exc:
                if self._may_retry(exc):
                    self._call = self._attempt()
                    self._messages = iter(self._call)
                    continue
                self._end()
                raise
            self._delivered = True
            if msg.index == 0:
                self._received.extend(msg.token_ids)
            return msg

    def cancel(self) -> bool:
        """Cancel the call; its reader gets ``CANCELLED``."""
        self._cancelled = True
        return self._call.cancel()
