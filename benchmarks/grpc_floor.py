"""What one streamed gRPC message costs grpc.aio itself, without the router: a bare server
streaming ``Generate`` responses in the router's shape (every stream gets one message per
step, a step every ``--period`` s, its streams woken a slice of 32 at a time), to one
``grpc.aio`` client with all streams at once; the server process's CPU per message.

It is the floor under the router's gRPC figures (``router_cost``: gRPC's CPU per token less
HTTP's is about this), for both handler shapes grpc offers: an async generator (grpc's own
loop over it) and the writer API (``await context.write``, what the servicer uses).

    .venv/bin/python -m benchmarks.grpc_floor            # 256 streams x 64 steps, ~30 s
    .venv/bin/python -m benchmarks.grpc_floor --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import time

from benchmarks.common import emit_json, print_table

SLICE = 32  # readers woken per loop iteration, as the router's demultiplexer does


def _serve(mode: str, messages: int, period_s: float, ports: mp.Queue) -> None:
    import grpc

    from protos.kvcluster.v1 import kvcluster_pb2 as pb
    from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc

    waiters: list[asyncio.Future] = []

    async def step() -> None:
        nonlocal waiters
        while True:
            await asyncio.sleep(period_s)
            woken, waiters = waiters, []
            for i, w in enumerate(woken):
                w.set_result(None)
                if (i + 1) % SLICE == 0:
                    await asyncio.sleep(0)

    async def next_step() -> None:
        w = asyncio.get_running_loop().create_future()
        waiters.append(w)
        await w

    def msg(i: int) -> pb.GenerateResponse:
        return pb.GenerateResponse(request_id="r", index=0, token_ids=[i], worker_id="w")

    class Generator(pb_grpc.KVClusterServicer):
        async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
            for i in range(messages):
                await next_step()
                yield msg(i)

    class Writer(pb_grpc.KVClusterServicer):
        async def Generate(self, request, context) -> None:  # noqa: ANN001, N802
            for i in range(messages):
                await next_step()
                await context.write(msg(i))

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_KVClusterServicer_to_server(
            Writer() if mode == "writer" else Generator(), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ticker = asyncio.ensure_future(step())
        ports.put(port)
        await asyncio.Event().wait()
        ticker.cancel()

    asyncio.run(main())


async def _client(port: int, streams: int) -> int:
    import grpc

    from protos.kvcluster.v1 import kvcluster_pb2 as pb
    from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.KVClusterStub(channel)

        async def one() -> int:
            return sum([1 async for _ in stub.Generate(pb.GenerateRequest(text="x"))])

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(mode: str, streams: int, messages: int, period_s: float) -> dict:
    ctx = mp.get_context("spawn")  # no grpc state forked from this process
    ports: mp.Queue = ctx.Queue()
    server = ctx.Process(target=_serve, args=(mode, messages, period_s, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        cpu0, t0 = _cpu_s(server.pid), time.perf_counter()
        got = asyncio.run(_client(port, streams))
        wall, cpu = time.perf_counter() - t0, _cpu_s(server.pid) - cpu0
    finally:
        server.kill()
        server.join(10)
    assert got == streams * messages, (got, streams * messages)
    return {"handler": mode, "messages": got, "wall s": wall, "server us/msg": 1e6 * cpu / got}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64, help="messages per stream")
    parser.add_argument("--period", type=float, default=0.05, help="seconds between steps")
    parser.add_argument("--repeat", type=int, default=2, help="runs per handler (best kept)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.streams, args.steps, args.period, args.repeat = 16, 8, 0.01, 1
    rows = []
    for mode in ("generator", "writer"):
        runs = [run(mode, args.streams, args.steps, args.period) for _ in range(args.repeat)]
        rows.append(min(runs, key=lambda r: r["server us/msg"]))  # noise only adds CPU
    print_table(rows, f"grpc.aio server CPU per streamed message, {args.streams} streams")
    head = {f"grpc_{r['handler']}_us_per_msg": round(r["server us/msg"], 1) for r in rows}
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
