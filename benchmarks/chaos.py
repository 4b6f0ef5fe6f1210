"""Chaos run: a live cluster under a mixed, abusive load while a worker and Redis die.

Starts a local cluster (2 workers, 2 routers, a real redis-server, the tiny model) and sends
a seeded mix of streams, unary calls, client cancels, disconnects, tight deadlines and
malformed requests through both routers; at 1/3 of the load it kills a worker actor (Ray
restarts it), at 2/3 it restarts Redis on the same port; then it freezes Redis (SIGSTOP)
under a steady load and reports latency while frozen and the time to use the index again.
It prints requests sent, completed, retried, failed by gRPC code, hung (must be 0), stuck on
a worker (must be 0), KV blocks leaked (must be 0) and worker memory after warm-up vs at the
end; ends with one JSON line.

    .venv/bin/python -m benchmarks.chaos            # 3000 requests
    .venv/bin/python -m benchmarks.chaos --smoke    # 150 requests, under 2 minutes

The load (``chaos_load.py``) and the probes (``chaos_probes.py``) are also the reliability
tests' toolkit (tests/reliability/).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import grpc
import ray

from benchmarks.chaos_faults import frozen_worker_recovery, router_kill_recovery
from benchmarks.chaos_load import MixedLoad
from benchmarks.chaos_probes import (
    blocks_in_use,
    queued,
    retries,
    router_stats,
    wait_idle,
    worker_rss,
)
from benchmarks.common import emit_json, print_table, pyplot, save_figure
from cluster.client import KVClusterClient
from cluster.launcher import Cluster

# -- the chaos run -----------------------------------------------------------------------------


@dataclass
class ChaosReport:
    sent: int  # requests sent
    completed: int  # ended OK
    retried: int  # moved to another worker by a router after a death before any token
    failed: dict[str, int]  # ended with an error, by gRPC code
    unexpected: int  # ended with a code their kind may not end with (must be 0)
    hung: int  # did not return within deadline + grace (must be 0)
    stuck: int  # still running or waiting on a worker after the load (must be 0)
    blocks_leaked: int  # KV blocks still referenced on the workers after the load (must be 0)
    rss_warm_mib: dict[str, float]  # worker RSS after warm-up
    rss_end_mib: dict[str, float]  # worker RSS at the end
    seconds: float  # wall clock of the measured load
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (s from start, code)
    events: list[tuple[float, str]] = field(default_factory=list)  # (s from start, fault)


def run_chaos(
    cluster: Cluster,
    n: int,
    *,
    seed: int = 0,
    concurrency: int = 8,
    warmup: int = 40,
    kill_worker: bool = True,
    restart_redis: bool = True,
    redis_down_s: float = 2.0,
    log: Callable[[str], None] = print,
) -> ChaosReport:
    """The mixed load on ``cluster`` with the faults; see the module docstring."""
    load = MixedLoad(cluster.endpoints, seed=seed)
    try:
        load.run(warmup, concurrency=concurrency, start=n)  # indices after the measured load
        wait_idle(cluster)
        rss_warm = worker_rss(cluster)
        retried0 = retries(cluster)
        load.done = 0
        t0 = time.monotonic()
        events: list[tuple[float, str]] = []

        def note(what: str) -> None:
            events.append((time.monotonic() - t0, what))
            log(f"[chaos] {what} after {load.done} requests")

        faults = threading.Thread(
            target=_inject,
            daemon=True,
            args=(
                cluster,
                load,
                n,
                kill_worker,
                restart_redis and cluster.redis is not None,
                redis_down_s,
                note,
            ),
        )
        faults.start()
        result = load.run(n, concurrency=concurrency)
        seconds = time.monotonic() - t0
        faults.join(timeout=120)
    finally:
        load.close()
    wait_idle(cluster)
    blocks = blocks_in_use(cluster)
    stuck = sum(r + w for r, w in queued(cluster).values())
    codes = Counter(o.code for o in result.outcomes)
    mib = 1 << 20
    return ChaosReport(
        sent=n,
        completed=codes.pop("OK", 0),
        retried=retries(cluster) - retried0,
        failed=dict(sorted(codes.items())),
        unexpected=len(result.unexpected(faults=kill_worker or restart_redis)),
        hung=result.hung,
        stuck=stuck,
        blocks_leaked=sum(blocks.values()),
        rss_warm_mib={w: v / mib for w, v in rss_warm.items()},
        rss_end_mib={w: v / mib for w, v in worker_rss(cluster).items()},
        seconds=seconds,
        timeline=sorted((o.ended - t0, o.code) for o in result.outcomes),
        events=events,
    )


def _inject(
    cluster: Cluster,
    load: MixedLoad,
    n: int,
    kill_worker: bool,
    restart_redis: bool,
    redis_down_s: float,
    note: Callable[[str], None],
) -> None:
    def reach(fraction: float) -> None:
        while load.done < n * fraction:
            time.sleep(0.05)

    if kill_worker:
        reach(1 / 3)
        note("worker-0 killed (Ray restarts it)")
        ray.kill(cluster.workers["worker-0"], no_restart=False)
    if restart_redis:
        reach(2 / 3)
        note("Redis stopped")
        cluster.redis.stop()
        time.sleep(redis_down_s)
        cluster.redis.start()
        note("Redis back")


@dataclass(frozen=True)
class FrozenRedisRow:
    """Redis SIGSTOPped for ``frozen_s`` under a steady load, then SIGCONTed."""

    frozen_s: float  # how long redis-server was stopped
    served: int  # requests that ended OK while it was frozen
    failed: int  # requests that failed while it was frozen (must be 0)
    p50_before_s: float  # request latency before the freeze
    p50_frozen_s: float  # ... while frozen (the breaker keeps it near the normal one)
    max_frozen_s: float  # slowest request while frozen (one probe's timeout at most)
    recovery_s: float  # thaw -> every router's index circuit closed and index available


def frozen_redis_row(
    cluster: Cluster, frozen_s: float = 10.0, *, warm_s: float = 3.0, timeout_s: float = 60.0
) -> FrozenRedisRow:
    """Freeze Redis (SIGSTOP: it keeps its connections and answers nothing) while requests
    flow through every router, thaw it, and time how long the routers take to use the index
    again."""
    import signal

    from kvstore.runtime.stats import quantile

    clients = [KVClusterClient(e) for e in cluster.endpoints]
    results: list[tuple[float, float, bool]] = []  # (start, seconds, ok)
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                clients[i % len(clients)].generate(
                    f"Frozen index {i}: what now?", max_tokens=2, timeout=timeout_s
                )
                ok = True
            except grpc.RpcError:
                ok = False
            results.append((t0, time.monotonic() - t0, ok))
            i += 1

    def index_back() -> bool:
        return all(
            not st.get("index_circuit_open", False) and st["index_available"]
            for st in router_stats(cluster).values()
        )

    pid = cluster.redis.proc.pid
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        time.sleep(warm_s)
        frozen_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(frozen_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        thawed = time.monotonic()
        while not index_back() and time.monotonic() - thawed < timeout_s:
            time.sleep(0.05)
        recovery = time.monotonic() - thawed
    finally:
        stop.set()
        loader.join(timeout_s)
        for c in clients:
            c.close()
    before = [s for t, s, _ in results if t < frozen_at]
    during = [(s, ok) for t, s, ok in results if frozen_at <= t < thawed]
    lat = [s for s, _ in during]
    return FrozenRedisRow(
        frozen_s=frozen_s,
        served=sum(ok for _, ok in during),
        failed=sum(not ok for _, ok in during),
        p50_before_s=quantile(before, 0.5, empty=0.0),
        p50_frozen_s=quantile(lat, 0.5, empty=0.0),
        max_frozen_s=max(lat, default=0.0),
        recovery_s=recovery,
    )


def plot(rep: ChaosReport, path: str = "chaos_timeline.png") -> None:
    """Requests ended per second, by code, with the faults marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    end = max((t for t, _ in rep.timeline), default=1.0)
    bins = [i * 0.5 for i in range(int(end / 0.5) + 2)]
    codes = sorted({c for _, c in rep.timeline})
    ax.hist(
        [[t for t, c in rep.timeline if c == code] for code in codes],
        bins=bins,
        stacked=True,
        label=codes,
    )
    for t, what in rep.events:
        ax.axvline(t, color="black", linestyle="--")
        ax.annotate(what, (t, ax.get_ylim()[1] * 0.95), rotation=90, fontsize=7, va="top")
    ax.set_xlabel("seconds into the load")
    ax.set_ylabel("requests ended per 0.5 s")
    ax.set_title(
        f"chaos run: {rep.sent} requests, {rep.hung} hung, {rep.blocks_leaked} blocks leaked"
    )
    ax.legend(fontsize=7)
    save_figure(fig, path)


def chaos_config(name: str):  # noqa: ANN201 - ClusterConfig
    from cluster.config import ClusterConfig

    return ClusterConfig.model_validate(
        {
            "name": name,
            "dashboard": False,
            "model": {"tiny_family": "llama"},
            "workers": {
                "num_workers": 2,
                "num_cpus_per_worker": 0.1,
                "engine": {
                    "num_blocks": 256,
                    "block_size": 16,
                    "max_waiting": 64,
                    "max_num_seqs": 8,
                    "max_num_batched_tokens": 256,
                    "max_model_len": 512,
                },
            },
            "router": {
                "port": 0,
                "num_routers": 2,
                "liveness": {"stream_stall_s": 2.0, "probe_timeout_s": 2.0},
            },
            "redis": {"heartbeat_ttl_s": 2.0},
        }
    )


def frozen_worker_row(cluster: Cluster) -> dict:
    """SIGSTOP a streaming worker: recovery = freeze until its clients were released (their
    streams ended UNAVAILABLE); new requests meanwhile must all be served elsewhere."""
    r = frozen_worker_recovery(cluster)
    shorts = r["short_requests"]
    worst = max((s for _, _, s in shorts), default=0.0)
    return {
        "fault": "frozen worker",
        "recovery s": _round(r["streams_released_s"]),
        "requests during fault": len(shorts),
        "served": sum(code == "OK" for _, code, _ in shorts),
        "detail": f"slowest of them {worst:.1f}s; status answered in {r['status_s']:.2f}s"
        f" listing it {'stale' if r['status_victim_stale'] else 'LIVE'}; live "
        f"again {_round(r['back_s'])}s after SIGCONT",
    }


def router_kill_row(cluster: Cluster) -> dict:
    """SIGKILL a router: recovery = kill until the same client's next call succeeded."""
    r = router_kill_recovery(cluster)
    return {
        "fault": "router kill",
        "recovery s": _round(r["recovery_s"]),
        "requests during fault": r["attempts"],
        "served": int(r["recovery_s"] is not None),
        "detail": f"restarted by Ray: {r['restarted']}, same port: {r['same_endpoint']}, "
        f"its open stream {r['open_stream'][0]} and stopped on the worker: "
        f"{r['orphans_freed']}",
    }


def _round(x: float | None) -> float:
    return float("nan") if x is None else round(x, 2)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="150 requests (under 2 minutes)")
    args = ap.parse_args(argv)
    n = 150 if args.smoke else args.requests
    t0 = time.monotonic()
    with Cluster(chaos_config(f"chaos-{os.getpid()}")) as cluster:
        print(f"cluster up in {time.monotonic() - t0:.0f}s; routers {cluster.endpoints}")
        rep = run_chaos(cluster, n, seed=args.seed, concurrency=args.concurrency)
        frozen = frozen_redis_row(cluster, 3.0 if args.smoke else 10.0)
        recovery = [frozen_worker_row(cluster), router_kill_row(cluster)]
    print_table(
        [
            {
                "sent": rep.sent,
                "completed": rep.completed,
                "retried": rep.retried,
                "failed": sum(rep.failed.values()),
                "unexpected": rep.unexpected,
                "hung": rep.hung,
                "stuck": rep.stuck,
                "blocks leaked": rep.blocks_leaked,
                "seconds": rep.seconds,
            }
        ],
        f"chaos run: {n} requests, worker kill + Redis restart",
    )
    print_table(
        [{"code": c, "requests": k} for c, k in rep.failed.items()],
        "failed, by gRPC code (every one a clear, expected code)",
    )
    print_table(
        [
            {
                "worker": w,
                "rss after warm-up MiB": rep.rss_warm_mib[w],
                "rss at end MiB": rep.rss_end_mib[w],
            }
            for w in sorted(rep.rss_warm_mib)
        ],
        "worker memory (worker-0 was killed and restarted mid-run)",
    )
    head = {
        "chaos_sent": rep.sent,
        "chaos_completed": rep.completed,
        "chaos_retried": rep.retried,
        **{f"chaos_failed_{c.lower()}": k for c, k in rep.failed.items()},
        "chaos_unexpected": rep.unexpected,
        "chaos_hung": rep.hung,
        "chaos_stuck": rep.stuck,
        "chaos_blocks_leaked": rep.blocks_leaked,
        "chaos_rss_growth_pct": round(
            100 * (max(rep.rss_end_mib[w] / rep.rss_warm_mib[w] for w in rep.rss_warm_mib) - 1), 1
        ),
        "chaos_seconds": round(rep.seconds, 1),
    }
    print_table([asdict(frozen)], "frozen Redis (SIGSTOP): served by load, then recovery")
    head.update(
        chaos_frozen_redis_served=frozen.served,
        chaos_frozen_redis_failed=frozen.failed,
        chaos_frozen_redis_p50_ratio=round(frozen.p50_frozen_s / max(frozen.p50_before_s, 1e-9), 2),
        chaos_frozen_redis_recovery_s=round(frozen.recovery_s, 2),
    )
    print_table(
        recovery, "faults Ray does not report: time to recover (stall timeout 2 s + probe 2 s)"
    )
    for row in recovery:
        head[f"chaos_{row['fault'].replace(' ', '_')}_recovery_s"] = row["recovery s"]
    plot(rep)
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
