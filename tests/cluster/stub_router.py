"""A stand-in router for client fault tests: a real gRPC server of the kvcluster.v1 service in
its own process, so a test can SIGKILL it, SIGSTOP it, or start another on the same port.

    python -m tests.cluster.stub_router PORT MODE [ROUTERS_FILE]

MODE ``serve``: Generate streams ``max_tokens`` messages (one token each, 20 ms apart),
GenerateUnary answers at once; ``stall``: every call is accepted and never answered.
A streamed message's ``worker_id`` names the port, so a test sees which server answered.
ClusterStatus lists the routers named in ROUTERS_FILE (one gRPC address a line, read at each
call, so a test changes the cluster's list; none without it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
TOKEN_GAP_S = 0.02


class StubRouter(pb_grpc.KVClusterServicer):
    def __init__(self, port: int, mode: str, routers_file: str | None = None) -> None:
        self.name = f"stub-{port}"
        self.mode = mode
        self.routers_file = routers_file

    def _stall(self, context: grpc.ServicerContext) -> None:
        while context.is_active():
            time.sleep(0.05)

    def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        if self.mode == "stall":
            self._stall(context)
            return
        n = request.params.max_tokens or 4
        for i in range(len(request.continue_from), n):  # a resumed stream: after those
            time.sleep(TOKEN_GAP_S)
            last = i == n - 1
            yield pb.GenerateResponse(
                request_id=request.request_id,
                token_ids=[i],
                text=f"{i} ",
                worker_id=self.name,
                finish_reason=pb.FINISH_REASON_LENGTH if last else 0,
            )

    def GenerateUnary(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> pb.GenerateResult:
        if self.mode == "stall":
            self._stall(context)
        return pb.GenerateResult(request_id=request.request_id, worker_id=self.name)

    def ClusterStatus(  # noqa: N802
        self, request: pb.ClusterStatusRequest, context: grpc.ServicerContext
    ) -> pb.ClusterStatusResponse:
        if self.mode == "stall":
            self._stall(context)
        listed = Path(self.routers_file).read_text().split() if self.routers_file else []
        return pb.ClusterStatusResponse(routers=[pb.RouterAddress(grpc_address=a) for a in listed])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubProcess:
    """One stub router process on ``port``; ``kill`` (SIGKILL, as a node dies), ``stop`` /
    ``resume`` (SIGSTOP / SIGCONT, as a host that hangs)."""

    def __init__(self, port: int, mode: str = "serve", routers_file: Path | None = None) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        extra = [str(routers_file)] if routers_file is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.stub_router", str(port), mode, *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready" once it listens
        assert line.strip() == b"ready", line

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()


def main() -> None:
    port, mode = int(sys.argv[1]), sys.argv[2]
    routers_file = sys.argv[3] if len(sys.argv) > 3 else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_KVClusterServicer_to_server(StubRouter(port, mode, routers_file), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
