"""The served worker's per-step and per-burst costs outside the model, as CPU time per thread.

    python -m benchmarks.worker_loop            # 128 and 256 streams, bursts of 128 x 512 tokens
    python -m benchmarks.worker_loop --smoke    # a few seconds
    python -m benchmarks.worker_loop --ray      # histograms of an initialized Ray (a driver)

``hook``: the telemetry's after-step hook (``WorkerTelemetry.after_step``) on synthetic
outputs, one token per stream per step, with Ray's real ``ray.util.metrics`` histograms; CPU
seconds of the calling thread (``time.thread_time``) per step, measured twice in the same
process: observing every latency in the step (``inline``: ``after_step`` then ``flush`` on
the same thread) and queued (``after_step`` alone: the engine thread's share in a served
worker), plus the flush (the heartbeat thread's share). ``ratio`` = inline / queued
engine-thread CPU.

``delivery``: the worker loop's own share of a step's outputs: a channel's ``deliver``
(``worker/channels.py``) and the packing of its next message, CPU ms per step; the rest of
the loop's per-step cost in a served worker is Ray's streaming-generator report of the
message (not measured here: no Ray).

``burst``: a ``WorkerServer`` (tiny model, no Ray) takes in ``--burst`` requests of
``--prompt`` tokens at once, through ``submit_many`` (checked in turns, taken in with one
command) and, as the baseline, as that many concurrent ``submit`` calls (one check, one
command and one answer each). Per path: the event loop's CPU seconds until every request
is admitted, its longest turn in CPU time (``max turn cpu ms``: the loop thread's CPU
between two wake-ups of a probe task sleeping 0 s, so what a ready callback waited for,
whatever the machine's load) and its largest stall in wall time (a 1 ms probe: noisy on a
busy machine).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from benchmarks.common import emit_json, print_table
from kvstore.blocks.looplag import LoopLagProbe
from kvstore.blocks.outputs import CompletionDelta, RequestOutput, Usage


def hook_cpu(streams: int, steps: int, metrics_api) -> dict:  # noqa: ANN001 - a module
    from worker.engine.metrics import EngineSnapshot
    from worker.telemetry import WorkerTelemetry

    snap = EngineSnapshot(*([0] * 18))
    rids = [f"r{i}" for i in range(streams)]

    def outputs() -> list[RequestOutput]:
        usage = Usage(8, 0, 1)
        return [RequestOutput(r, [CompletionDelta(0, "", [7])], False, usage) for r in rids]

    row: dict = {"streams": streams, "steps": steps}
    for mode in ("inline", "queued"):
        tel = WorkerTelemetry("bench", metrics_api=metrics_api)
        for rid in rids:
            tel.arrived(rid)
        batches = [outputs() for _ in range(steps)]
        hook = flush = 0.0
        for outs in batches:
            t0 = time.thread_time()
            tel.after_step(snap, outs)
            if mode == "inline":
                tel.flush()
            t1 = time.thread_time()
            hook += t1 - t0
            if mode == "queued" and len(tel._pending) >= 8:  # the heartbeat's turn
                tel.flush()
                flush += time.thread_time() - t1
        t1 = time.thread_time()
        tel.flush()
        flush += time.thread_time() - t1
        row[f"{mode} engine ms/step"] = 1e3 * hook / steps
        if mode == "queued":
            row["flush ms/step"] = 1e3 * flush / steps
    row["ratio"] = row["inline engine ms/step"] / max(row["queued engine ms/step"], 1e-9)
    return row


def delivery_cpu(streams: int, steps: int) -> dict:
    from worker.channels import Channel

    async def run() -> float:
        ch = Channel("bench", asyncio.get_running_loop(), lambda rid: None)
        batches = ch.batches()
        usage = Usage(8, 0, 1)
        cpu = 0.0
        for _ in range(steps):
            outs = [
                RequestOutput(f"r{i}", [CompletionDelta(0, "", [7])], False, usage)
                for i in range(streams)
            ]
            t0 = time.thread_time()
            ch.deliver(outs)
            message = await batches.__anext__()
            cpu += time.thread_time() - t0
            assert len(message) == streams
        return cpu

    return {"streams": streams, "loop ms/step": 1e3 * asyncio.run(run()) / steps}


def burst_cpu(burst: int, prompt: int, rounds: int) -> list[dict]:
    from kvstore.blocks.protocol import WorkerRequest
    from worker.actor import WorkerServer, WorkerSettings
    from worker.engine import EngineConfig, SamplingParams
    from worker.model.build_tiny import build_tiny_model

    model = build_tiny_model(None, "llama", "tiny")
    cfg = EngineConfig(num_blocks=4096, max_waiting=4 * burst, max_num_seqs=64)
    server = WorkerServer(WorkerSettings("worker-b", str(model), "m", cfg, None))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    seq = iter(range(1 << 30))

    def requests() -> list[WorkerRequest]:
        return [
            WorkerRequest(f"q{next(seq)}", [rng.randrange(1, 500) for _ in range(prompt)], params)
            for _ in range(burst)
        ]

    async def turns(longest: list[float]) -> None:
        """The loop thread's CPU between two of this task's turns."""
        last = time.thread_time()
        while True:
            await asyncio.sleep(0)
            now = time.thread_time()
            longest[0] = max(longest[0], now - last)
            last = now

    async def one(path: str) -> tuple[float, float, float]:
        reqs = requests()
        longest = [0.0]
        probe = LoopLagProbe(0.001)
        probe.report(reset=True)
        await asyncio.sleep(0.01)
        probe.report(reset=True)
        watch = asyncio.create_task(turns(longest))
        await asyncio.sleep(0)
        longest[0] = 0.0
        t0 = time.thread_time()
        if path == "submit_many":
            results = await server.submit_many(reqs, None, "bench")
        else:
            results = await asyncio.gather(
                *(server.submit(r, None, "bench") for r in reqs), return_exceptions=True
            )
        cpu = time.thread_time() - t0
        await asyncio.sleep(0)
        turn = longest[0]
        watch.cancel()
        await asyncio.sleep(0.005)
        lag = probe.report()["max_lag_ms"]
        probe.stop()
        bad = [r for r in results if isinstance(r, BaseException)]
        assert not bad, bad[:3]
        while (await server.status()).running + (await server.status()).waiting:
            await asyncio.sleep(0.01)  # the burst finished: the next starts from idle
        server.streams.channels.drop("bench")  # nobody reads it: its outputs would grow the heap
        return cpu, turn, lag

    async def main() -> list[dict]:
        rows = []
        await one("submit_many")  # warm-up
        for path in ("concurrent submit", "submit_many"):
            cpus, turns_, lags = zip(*[await one(path) for _ in range(rounds)], strict=True)
            rows.append(
                {
                    "path": path,
                    "burst": burst,
                    "prompt": prompt,
                    "loop cpu ms/burst": 1e3 * min(cpus),
                    "max turn cpu ms": 1e3 * max(turns_),
                    "max stall ms": max(lags),
                }
            )
        return rows

    try:
        return asyncio.run(main())
    finally:
        server.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--ray", action="store_true", help="ray.init() first (a driver's metrics)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--burst", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.burst, args.prompt, args.rounds = 20, 16, 64, 1
    import ray
    from ray.util import metrics

    if args.ray:
        ray.init(address="local", num_cpus=1, include_dashboard=False)
    hooks = [hook_cpu(n, args.steps, metrics) for n in ((16,) if args.smoke else (128, 256))]
    print_table(hooks, "after-step telemetry: CPU ms per step of the calling thread")
    sizes = (16,) if args.smoke else (128, 256)
    deliveries = [delivery_cpu(n, args.steps) for n in sizes]
    print_table(deliveries, "a step's outputs on the worker's event loop (deliver + pack)")
    bursts = burst_cpu(args.burst, args.prompt, args.rounds)
    print_table(bursts, "a burst's admission on the worker's event loop")
    headline = {f"hook_{h['streams']}_ratio": round(h["ratio"], 2) for h in hooks}
    for h in hooks:
        headline[f"hook_{h['streams']}_queued_ms"] = round(h["queued engine ms/step"], 4)
    for d in deliveries:
        headline[f"delivery_{d['streams']}_loop_ms"] = round(d["loop ms/step"], 4)
    old, new = bursts
    headline["burst_loop_cpu_ratio"] = round(
        old["loop cpu ms/burst"] / max(new["loop cpu ms/burst"], 1e-9), 2
    )
    headline["burst_max_turn_cpu_ms"] = round(new["max turn cpu ms"], 2)
    headline["baseline_max_turn_cpu_ms"] = round(old["max turn cpu ms"], 2)
    headline["burst_max_stall_ms"] = round(new["max stall ms"], 2)
    emit_json(headline)
    return headline


if __name__ == "__main__":
    main()
