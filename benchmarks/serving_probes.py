"""Probes into a running cluster for ``benchmarks/serving_path.py``: the actors' event-loop
lag, the engine thread's busy time, the router process's CPU time, and how fast a burst of
requests is taken in by a busy worker."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import ray

from benchmarks.stream_clients import run_grpc
from cluster.launcher import Cluster
from kvstore.blocks.protocol import WorkerRequest
from kvstore.blocks.sampling_params import SamplingParams


def loop_lags(cluster: Cluster, *, reset: bool, trace: bool = False) -> dict[str, Any]:
    """The largest event-loop stall (ms) of any worker and of any router since the last reset
    (the first call starts the probes); None for actors without a probe. ``trace``: the
    probes attribute stalls from now on; once on, ``worker_stalls`` / ``router_stalls`` list
    the longest stalls since the last reset (see :func:`stall_split`)."""
    try:
        return _loop_lags(cluster, reset, trace)
    except (AttributeError, TypeError):  # an older build without the probe (or its trace)
        return {"worker": None, "router": None}


def _loop_lags(cluster: Cluster, reset: bool, trace: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, handles in (("worker", cluster.workers), ("router", cluster.routers)):
        reports = ray.get([h.loop_lag.remote(reset=reset, trace=trace) for h in handles.values()])
        out[side] = max(r["max_lag_ms"] for r in reports)
        out[f"{side}_loop"] = ",".join(sorted({r.get("loop", "?") for r in reports}))
        out[f"{side}_sched"] = sched_summary([r.get("sched") for r in reports])
        if side == "worker":  # the engine threads' (kvstore/blocks/loop_sched.py)
            out["engine_sched"] = sched_summary([r.get("engine_sched") for r in reports])
        stalls = [s for r in reports for s in r.get("trace", {}).get("stalls", [])]
        if any("trace" in r for r in reports):
            out[f"{side}_stalls"] = sorted(stalls, key=lambda s: -s["lag_ms"])
    return out


def sched_summary(reports: list[dict | None]) -> str:
    """The loop (or engine) threads' slice and niceness, e.g. ``slice 0.1 ms nice 0``."""
    seen = {
        f"slice {r['slice_ms']:g} ms nice {r['nice']}" if r.get("slice_ms") else f"nice {r['nice']}"
        for r in reports
        if r
    }
    return ",".join(sorted(seen)) or "?"


def stall_split(stalls: list[dict], top: int = 3) -> str:
    """The longest stalls as ``lag ms = loop CPU + collector + run-queue wait``: what the
    loop's own callbacks took, what the cyclic collector took (inside that CPU), and how long
    the OS kept the runnable loop thread off a core (other processes and threads on it)."""
    return ", ".join(
        f"{s['lag_ms']:.0f} (cpu {s['loop_cpu_ms']:.0f}, gc {s['gc_ms']:.0f}, "
        f"runq {s['runq_ms']:.0f})"
        for s in stalls[:top]
    )


def own_lag_ms(stalls: list[dict]) -> float:
    """The longest stall less its run-queue wait: the part the process itself is
    answerable for (its callbacks, its collections, its threads holding the GIL); 0 when
    no stall reached the tracer's threshold."""
    return max((max(0.0, s["lag_ms"] - s["runq_ms"]) for s in stalls), default=0.0)


def engine_busy(cluster: Cluster) -> float | None:
    """Seconds the engine thread of the (first) worker spent on commands and steps."""
    h = next(iter(cluster.workers.values()))
    return ray.get(h.__ray_call__.remote(lambda w: getattr(w.engine_loop, "busy_s", None)))


def stage_seconds(cluster: Cluster) -> Any:
    """The (first) worker's engine stage timers so far (None: a build without them)."""
    h = next(iter(cluster.workers.values()))

    def read(w: Any) -> Any:
        stages = getattr(w.engine.stats, "stages", None)
        return stages.snapshot() if stages is not None else None

    return ray.get(h.__ray_call__.remote(read))


def engine_steps(cluster: Cluster) -> int:
    h = next(iter(cluster.workers.values()))
    return ray.get(h.__ray_call__.remote(lambda w: getattr(w.engine_loop, "steps", 0)))


def runnable_wait(native_id: int | None = None) -> float:
    """Seconds a thread (default: the calling one) was runnable but waiting for a core (the
    kernel's schedstat; 0.0 where there is none): CPU the machine did not give it."""
    import os
    import threading

    tid = threading.get_native_id() if native_id is None else native_id
    try:
        with open(f"/proc/{os.getpid()}/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_times(cluster: Cluster) -> dict[str, float]:
    """CPU seconds so far of the (first) worker's process, of its engine thread, and of the
    (first) router's process: what a run costs whatever else shares the machine; and the
    seconds the engine thread waited, runnable, for a core (``engine_wait``)."""

    def times(server: object) -> tuple[float, float, float]:  # runs in the worker
        from benchmarks.serving_probes import runnable_wait

        thread = server.engine_loop.thread  # type: ignore[attr-defined]
        if thread is None:
            return time.process_time(), 0.0, 0.0
        clock = time.pthread_getcpuclockid(thread.ident)
        return time.process_time(), time.clock_gettime(clock), runnable_wait(thread.native_id)

    w = next(iter(cluster.workers.values()))
    worker, engine, wait = ray.get(w.__ray_call__.remote(times))
    return {"worker": worker, "engine": engine, "router": router_cpu(cluster), "engine_wait": wait}


def submit_calls(cluster: Cluster) -> int | None:
    """Submit calls the (first) router sent its workers so far (a call carries the requests
    gathered for one worker); None for a build that sends one per request."""
    h = next(iter(cluster.routers.values()))
    return ray.get(
        h.__ray_call__.remote(
            lambda r: getattr(getattr(r.directory, "submits", None), "calls", None)
        )
    )


def router_cpu(cluster: Cluster) -> float:
    """CPU seconds the router's process used so far (every thread: the loop, Ray's, gRPC's)."""
    h = next(iter(cluster.routers.values()))
    return ray.get(h.__ray_call__.remote(lambda r: time.process_time()))


def burst_admission(
    cluster: Cluster, burst: int, vocab: int, prompt: int, *, busy_streams: int
) -> dict[str, float] | None:
    """``burst`` requests sent at once straight to a worker that is busy with
    ``busy_streams`` long streams: the wall time and engine steps until the engine took every
    one in (each ``submit`` answers once its request is queued in the engine)."""
    worker = next(iter(cluster.workers.values()))
    if not ray.get(worker.__ray_call__.remote(lambda w: hasattr(w, "submit"))):
        return None  # an older build: requests arrive on their own streams only
    max_len = ray.get(worker.__ray_call__.remote(lambda w: w.engine.max_model_len))
    long_tokens = max_len - prompt - 1
    busy_prompts = [
        [5 + (i * 7 + j) % (vocab - 5) for j in range(prompt)] for i in range(busy_streams)
    ]
    load = threading.Thread(
        target=run_grpc, args=(cluster.endpoints[0], busy_prompts, long_tokens), daemon=True
    )
    load.start()
    steps0 = engine_steps(cluster)
    while engine_steps(cluster) < steps0 + 3:  # the busy streams are being decoded
        time.sleep(0.01)
    channel = f"burst-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    requests = [
        WorkerRequest(
            uuid.uuid4().hex, [5 + (i * 13 + j) % (vocab - 5) for j in range(prompt)], params, False
        )
        for i in range(burst)
    ]
    before = engine_steps(cluster)
    t0 = time.perf_counter()
    ray.get([worker.submit.remote(r, None, channel) for r in requests])
    ms = 1e3 * (time.perf_counter() - t0)
    steps = engine_steps(cluster) - before
    ray.get(worker.__ray_call__.remote(lambda w: w.streams.channels.drop(channel)))
    load.join(600)
    return {"requests": burst, "ms": round(ms, 1), "steps": steps}
