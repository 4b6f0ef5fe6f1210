"""How late an event loop wakes next to busy compute threads, per scheduling policy.

    python -m benchmarks.loop_latency            # 5 s per run, 2 rounds, both placements
    python -m benchmarks.loop_latency --smoke    # a few seconds

An asyncio loop in its own thread (as a Ray actor's) sleeps 1 ms again and again and records
how late each wake-up is; beside it ``--engines`` compute threads (torch matmuls of
``--size``, ``--intra`` intra-op threads each: an engine thread and its OpenMP team) and
``--neighbours`` processes spinning in Python (a client, another process's work, never
demoted). ``--placement``: ``process`` runs the compute threads in a child process (a router
beside a worker), ``thread`` in the loop's own process (a worker's loop beside its engine).
Policies (``kvstore/runtime/threadsched.py``):

* ``none``: everything as it starts;
* ``slice``: the loop thread asks for a ``--slice-ms`` slice (Linux 6.12+);
* ``nice``: the compute threads run ``--nice`` points nicer (set on the engine thread before
  its team exists: the team inherits it);
* ``both``: the two together; ``batch``: the compute threads under SCHED_BATCH instead.

Per run: the loop's wake lateness (p50, p99, max, wakes later than 10 ms), the loop thread's
wait for a core per wake-up (the kernel's schedstat), the compute threads' matmuls per second
and the neighbours' spins per second, each also as a ratio to ``none`` in the same round.
Rounds interleave the policies. Table, one JSON line (the medians over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time

from benchmarks.common import emit_json, print_table
from kvstore.runtime import threadsched

POLICIES = ("none", "slice", "nice", "both", "batch")


def _schedstat_wait_s(tid: int) -> float:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Counters:
    """Shared with the child processes: who started, the work done while the loop probed
    (from ``go`` to ``stop``), the compute threads' niceness in effect."""

    def __init__(self, ctx) -> None:  # noqa: ANN001 - a multiprocessing context
        self.go, self.stop = ctx.Event(), ctx.Event()
        self.started, self.done, self.nice = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)

    def add(self, value, n: int) -> None:  # noqa: ANN001
        with value.get_lock():
            value.value += n

    def count_until_stop(self, step) -> None:  # noqa: ANN001
        """``step()`` until ``stop``; what ran after ``go`` is added to ``done``."""
        self.add(self.started, 1)
        n = n0 = 0
        while not self.stop.is_set():
            step()
            n += 1
            if not n0 and self.go.is_set():
                n0 = n
        self.add(self.done, n - n0 if n0 else 0)


def compute(c: Counters, intra: int, size: int, nice: int, batch: bool) -> None:
    """One engine thread: demoted first (its OpenMP team, made by its first matmul, inherits
    the niceness), then matmuls until ``stop``."""
    import torch

    if nice:
        threadsched.set_nice(threadsched.nice() + nice)
    if batch:
        threadsched.set_policy(threadsched.SCHED_BATCH)
    c.nice.value = threadsched.nice()
    torch.set_num_threads(intra)
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    a @ b
    c.count_until_stop(lambda: a @ b)


def compute_process(c: Counters, engines: int, *spec: object) -> None:
    threads = [threading.Thread(target=compute, args=(c, *spec)) for _ in range(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def spin(c: Counters) -> None:
    def step() -> None:
        for _ in range(10_000):
            pass

    c.count_until_stop(step)


def probe_loop(seconds: float, slice_ms: float | None, out: dict) -> None:
    """The loop thread: its policy, then 1 ms sleeps for ``seconds``."""
    if slice_ms is not None:
        threadsched.set_slice(slice_ms / 1e3)
    tid = threading.get_native_id()
    out["slice_ms"] = threadsched.slice_ns() / 1e6

    async def run() -> list[float]:
        lates: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lates.append(time.perf_counter() - t0 - 0.001)
        return lates

    wait0 = _schedstat_wait_s(tid)
    out["lates"] = asyncio.run(run())
    out["wait_s"] = _schedstat_wait_s(tid) - wait0


def one_run(policy: str, args: argparse.Namespace, placement: str) -> dict:
    ctx = mp.get_context("spawn")
    comp, spins = Counters(ctx), Counters(ctx)
    spins.go, spins.stop = comp.go, comp.stop
    nice = args.nice if policy in ("nice", "both") else 0
    spec = (args.intra, args.size, nice, policy == "batch")
    procs = [ctx.Process(target=spin, args=(spins,)) for _ in range(args.neighbours)]
    threads: list[threading.Thread] = []
    if placement == "process":
        procs.append(ctx.Process(target=compute_process, args=(comp, args.engines, *spec)))
    else:
        threads = [
            threading.Thread(target=compute, args=(comp, *spec)) for _ in range(args.engines)
        ]
    for p in procs:
        p.start()
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while (comp.started.value, spins.started.value) != (args.engines, args.neighbours):
        assert time.monotonic() < deadline, "compute threads did not start in 120 s"
        time.sleep(0.05)
    time.sleep(args.settle)  # all run: let the scheduler settle
    out: dict = {}
    slice_ms = args.slice_ms if policy in ("slice", "both") else None
    loop = threading.Thread(target=probe_loop, args=(args.seconds, slice_ms, out))
    comp.go.set()
    t0 = time.perf_counter()
    loop.start()
    loop.join()
    wall = time.perf_counter() - t0
    comp.stop.set()
    for t in threads:
        t.join()
    for p in procs:
        p.join()
    lates = sorted(out["lates"])
    q = statistics.quantiles(lates, n=100, method="inclusive") if len(lates) > 1 else lates * 99
    return {
        "placement": placement,
        "policy": policy,
        "wakes": len(lates),
        "p50 ms": q[49] * 1e3,
        "p99 ms": q[98] * 1e3,
        "max ms": lates[-1] * 1e3,
        "over 10ms": sum(x > 0.010 for x in lates),
        "wait/wake ms": out["wait_s"] / max(len(lates), 1) * 1e3,
        "loop slice ms": out["slice_ms"],
        "compute nice": comp.nice.value,
        "matmul/s": comp.done.value / wall,  # while the loop probed
        "spin/s": spins.done.value / wall,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="0.3 s runs, one round, in-process")
    ap.add_argument("--seconds", type=float, default=5.0, help="probe time per run")
    ap.add_argument("--settle", type=float, default=0.5, help="all running, before the probe")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all policies")
    ap.add_argument("--placement", nargs="+", default=["process", "thread"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--engines", type=int, default=1, help="compute threads")
    ap.add_argument("--intra", type=int, default=2, help="intra-op threads per engine")
    ap.add_argument("--size", type=int, default=256, help="matmul size")
    ap.add_argument("--neighbours", type=int, default=1, help="spinning processes (nice 0)")
    ap.add_argument("--slice-ms", type=float, default=0.1, help="the loop thread's slice")
    ap.add_argument("--nice", type=int, default=5, help="points added to compute niceness")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seconds, args.settle, args.rounds = 0.3, 0.1, 1
        args.placement = ["thread"]
    rows = []
    for r in range(args.rounds):
        for placement in args.placement:
            batch = [one_run(p, args, placement) for p in args.policies]
            base = next((x for x in batch if x["policy"] == "none"), batch[0])
            for x in batch:
                x["round"] = r
                x["matmul ratio"] = x["matmul/s"] / max(base["matmul/s"], 1e-9)
                x["spin ratio"] = x["spin/s"] / max(base["spin/s"], 1e-9)
            rows += batch
    print_table(rows, f"loop wake lateness, {args.engines} engine(s) x {args.intra} threads")
    head: dict = {"kernel": __import__("os").uname().release}
    for placement in args.placement:
        for p in args.policies:
            mine = [x for x in rows if x["placement"] == placement and x["policy"] == p]
            key = f"{placement}_{p}"
            head[f"{key}_max_ms"] = round(statistics.median(x["max ms"] for x in mine), 2)
            head[f"{key}_p99_ms"] = round(statistics.median(x["p99 ms"] for x in mine), 2)
            head[f"{key}_wait_ms"] = round(statistics.median(x["wait/wake ms"] for x in mine), 3)
            # the policy in effect, as the kernel reported it
            head[f"{key}_loop_slice_ms"] = mine[0]["loop slice ms"]
            head[f"{key}_compute_nice"] = mine[0]["compute nice"]
            head[f"{key}_matmul_ratio"] = round(
                statistics.median(x["matmul ratio"] for x in mine), 3
            )
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
