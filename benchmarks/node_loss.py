"""Node loss under steady load: a kvcluster on 3 Ray nodes (Ray's multi-node test cluster:
three raylets on this machine), a router on every node and the workers spread; clients with
every router's address send greedy requests back to back. Then one node is killed (its router
and worker with it), a node joins, and another node is killed.

    python -m benchmarks.node_loss [--smoke] [--clients N] [--phase-s S]

Reports failed requests (by code), migrated streams, after each kill the seconds of reduced
throughput (1 s bins under 90 % of the surviving nodes' share of the throughput before it) and
the seconds until the first bin back at that share (target: 5 s), the time from the kill to the
dead node's workers leaving the index (their registrations no longer live and no lookup
finding their entries), the routers' placements on them after that until they are back (each
router counts its placements per worker: target 0) and the time to their being live again
elsewhere (Ray restarts them), split into the restarted workers' model load (as each worker
reports it) and the rest (Ray's detection and restart); the time from a node joining to its
router serving (``rejoin_serving_s``, from Ray knowing the node: its raylet's own start is
``node_start_s``) against the workers' model load time (``model_load_s``),
their difference (``rejoin_overhead_s``, target 5 s), the CPU seconds the new router's process
used until it served (``rejoin_router_cpu_s``), and the time to full throughput. After the load
stops one more node joins (``quiet_rejoin_*``): on this machine the joining node's processes
share its two cores with three nodes' engines, which stretches every start several-fold; at
rest the join costs what it would on a node with cores of its own. A PNG timeline of
throughput and errors, and a final JSON line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc
import ray

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.node_loss_watch import (
    WAIT_S,
    IndexWatch,
    model_load_s,
    node_of,
    router_names,
    router_stats,
)
from cluster.client import KVClusterClient
from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from cluster.local_ray import leave_loopback_ray, use_loopback_ray
from kvstore.index import KVIndex

NODE_CPUS = 2
FULL = {"clients": 12, "max_tokens": 32, "phase_s": 20.0}
SMOKE = {"clients": 3, "max_tokens": 8, "phase_s": 4.0}


@dataclass(frozen=True, slots=True)
class Done:
    t: float  # seconds since the load started, at the request's end
    code: str  # "OK" or the gRPC status name
    tokens: int


class SteadyLoad:
    """``clients`` threads sending greedy requests back to back, each client with every
    router address (its own rotation), until :meth:`stop`."""

    def __init__(self, addresses: list[str], clients: int, max_tokens: int) -> None:
        self.addresses = addresses
        self.max_tokens = max_tokens
        self.done: list[Done] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]
        for t in self._threads:
            t.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _run(self, i: int) -> None:
        k = i % len(self.addresses)
        with KVClusterClient(self.addresses[k:] + self.addresses[:k]) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    out = client.generate(
                        f"Client {i} request {n}: the weather over the harbour.",
                        max_tokens=self.max_tokens,
                        temperature=0.0,
                        ignore_eos=True,
                        timeout=60,
                    )
                    done = Done(self.now(), "OK", out.completion_tokens)
                except grpc.RpcError as exc:
                    done = Done(self.now(), exc.code().name, 0)
                    time.sleep(0.05)
                with self._lock:
                    self.done.append(done)

    def stop(self) -> list[Done]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        with self._lock:
            return list(self.done)


def _bins(done: list[Done], end: float) -> tuple[list[float], list[int]]:
    """Tokens per second and failed requests per 1 s bin."""
    n = int(end) + 1
    tok, err = [0.0] * n, [0] * n
    for d in done:
        b = min(int(d.t), n - 1)
        if d.code == "OK":
            tok[b] += d.tokens
        else:
            err[b] += 1
    return tok, err


def reduced_seconds(tok: list[float], at: float, until: float, share: float) -> int:
    """1 s bins in [at, until) under 90 % of ``share`` x the mean throughput of the bins
    before ``at`` (the first second skipped: start-up)."""
    before = tok[1 : int(at)]
    base = sum(before) / len(before) if before else 0.0
    return sum(1 for b in range(int(at), min(int(until), len(tok))) if tok[b] < 0.9 * share * base)


def recovered_seconds(tok: list[float], at: float, until: float, share: float) -> float | None:
    """Seconds from ``at`` to the start of the first 1 s bin at 90 % of ``share`` x the mean
    throughput before ``at`` (0: the kill's own bin held it; None: not before ``until``)."""
    before = tok[1 : int(at)]
    base = sum(before) / len(before) if before else 0.0
    for b in range(int(at), min(int(until), len(tok))):
        if tok[b] >= 0.9 * share * base:
            return max(0.0, b - at)
    return None


def join_node(ray_nodes: Any, cluster: Cluster) -> tuple[float, float | None, float | None]:
    """Add a node and wait for its router to serve a request: (seconds the node took to start,
    until Ray knew it; seconds from there to its router serving, None: not within
    ``WAIT_S``; the CPU seconds its router's process used until it served)."""
    before, names = set(cluster.router_endpoints()), router_names(cluster)
    t0 = time.monotonic()
    ray_nodes.add_node(num_cpus=NODE_CPUS)  # returns once its raylet runs and Ray knows it
    t_seen = time.monotonic()
    deadline = t_seen + WAIT_S
    while time.monotonic() < deadline:
        for address in set(cluster.router_endpoints()) - before:
            try:
                with KVClusterClient(address, retries=0) as c:
                    c.generate("Are you there?", max_tokens=1, timeout=5)
            except grpc.RpcError:
                continue
            serving_s = time.monotonic() - t_seen
            new = router_stats(cluster, router_names(cluster) - names).values()
            cpu = [s["serving_cpu_s"] for s in new if s.get("serving_cpu_s") is not None]
            return t_seen - t0, serving_s, cpu[0] if cpu else None
        time.sleep(0.2)
    return t_seen - t0, None, None


def overhead(serving_s: float | None, load_s: float | None) -> float | None:
    return serving_s - load_s if serving_s is not None and load_s is not None else None


def run(ray_nodes: Any, cluster: Cluster, *, clients: int, max_tokens: int, phase_s: float) -> dict:
    """The scenario on a running 3-node cluster (``ray_nodes``: its
    ``ray.cluster_utils.Cluster``); returns the figures."""
    index = KVIndex(cluster.index_config())
    load = SteadyLoad(cluster.router_endpoints(), clients, max_tokens)
    events: list[tuple[float, str]] = []
    watches: list[IndexWatch] = []

    def kill_one() -> None:
        """Kill the (non-head) node that holds the most live workers (and a router)."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        live = index.live_workers()
        placed = {w: node_of(h) for w, h in cluster.workers.items() if w in live}
        candidates = [n for n in ray_nodes.worker_nodes if n.node_id in alive]
        node = max(candidates, key=lambda n: sum(p == n.node_id for p in placed.values()))
        victims = {w: live[w].epoch for w, p in placed.items() if p == node.node_id}
        watch = IndexWatch(cluster, victims)
        events.append((load.now(), "kill"))
        watch.start()
        ray_nodes.remove_node(node, allow_graceful=False)
        watches.append(watch)

    time.sleep(phase_s)
    kill_one()
    time.sleep(phase_s)
    placed_on_dead = [watches[0].placed_on_dead()]
    # the model load a node that joins is measured against: the workers' own, as they report
    # them (the median: one start slowed by a busy moment does not set it)
    loads = sorted(model_load_s(cluster, sorted(cluster.workers)).values())
    join_load_s = loads[len(loads) // 2] if loads else None
    t_join = load.now()
    events.append((t_join, "join"))
    node_start_s, router_s, router_cpu_s = join_node(ray_nodes, cluster)
    time.sleep(phase_s)
    kill_one()
    time.sleep(phase_s)
    placed_on_dead.append(watches[1].placed_on_dead())
    end = load.now()
    done = load.stop()
    # a node joining a cluster at rest: what the join itself costs where the node's processes
    # get a core (under the load above, three nodes' engines hold this machine's two)
    _, quiet_router_s, quiet_router_cpu_s = join_node(ray_nodes, cluster)
    for watch in watches:  # a restart still loading gets one more phase
        watch.stop(phase_s)
    index.close()
    # the routers live now (a dead node's took their counts with them)
    moved = sum(sum(s["migrations"].values()) for s in router_stats(cluster).values())
    tok, err = _bins(done, end)
    kills = [t for t, e in events if e == "kill"]
    base = tok[1 : int(kills[0])]
    base_rate = sum(base) / len(base) if base else 0.0
    back_s = next(
        (
            max(0.0, b - t_join)
            for b in range(int(t_join), int(kills[1]))
            if tok[b] >= 0.9 * base_rate
        ),
        None,
    )
    codes = Counter(d.code for d in done if d.code != "OK")
    figures = {
        "requests": len(done),
        "failed": sum(codes.values()),
        "migrated_streams": moved,
        "reduced_s_first_kill": reduced_seconds(tok, kills[0], t_join, 2 / 3),
        "reduced_s_second_kill": reduced_seconds(tok, kills[1], end, 2 / 3),
        "recovered_s_first_kill": recovered_seconds(tok, kills[0], t_join, 2 / 3),
        "recovered_s_second_kill": recovered_seconds(tok, kills[1], end, 2 / 3),
        "index_purged_s_first_kill": watches[0].purged_s,
        "index_purged_s_second_kill": watches[1].purged_s,
        # over the kills whose node held workers (None: no purge seen)
        "placed_on_dead_after_purge": (
            sum(n for n in placed_on_dead if n is not None)
            if any(n is not None for n in placed_on_dead)
            else None
        ),
        "workers_back_s_first_kill": watches[0].back_s,
        "workers_back_s_second_kill": watches[1].back_s,
        # of those, the restarted workers' model load, and the rest (Ray's detection and
        # restart, the registration)
        "worker_load_s_first_kill": watches[0].load_s,
        "worker_load_s_second_kill": watches[1].load_s,
        "restart_overhead_s_first_kill": watches[0].restart_overhead_s,
        "restart_overhead_s_second_kill": watches[1].restart_overhead_s,
        # the join: the node's start (its raylet, until Ray knows it), then from there the
        # node serving, against a model load (target: overhead <= 5 s)
        "node_start_s": node_start_s,
        "rejoin_serving_s": router_s,
        "model_load_s": join_load_s,
        "rejoin_overhead_s": overhead(router_s, join_load_s),
        # the CPU seconds the joining node's router process used until it served
        "rejoin_router_cpu_s": router_cpu_s,
        "quiet_rejoin_serving_s": quiet_router_s,
        "quiet_rejoin_overhead_s": overhead(quiet_router_s, join_load_s),
        "quiet_rejoin_router_cpu_s": quiet_router_cpu_s,
        "full_throughput_after_join_s": back_s,
        "tokens_per_s_before": base_rate,
    }
    _plot(tok, err, events)
    return {"figures": figures, "errors": dict(codes)}


def _plot(tok: list[float], err: list[int], events: list[tuple[float, str]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(range(len(tok)), tok, label="tokens/s")
    ax2 = ax.twinx()
    ax2.bar(range(len(err)), err, color="tab:red", alpha=0.5, label="failed requests")
    for t, what in events:
        ax.axvline(t, color="black" if what == "kill" else "tab:green", linestyle="--")
        ax.text(t, max(tok or [1]), f" {what}", va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens/s (completed requests)")
    ax2.set_ylabel("failed requests")
    ax2.set_ylim(0, max(err, default=0) + 1)  # none failed: a flat axis from 0, not around it
    save_figure(fig, "node_loss.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a short run (checks it works)")
    p.add_argument("--clients", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--phase-s", type=float)
    args = p.parse_args(argv)
    sizes = dict(SMOKE if args.smoke else FULL)
    for key in sizes:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    from ray.cluster_utils import Cluster as RayNodes

    use_loopback_ray()
    nodes = RayNodes(
        initialize_head=True,
        head_node_args={
            "num_cpus": NODE_CPUS,
            "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    try:
        for _ in range(2):
            nodes.add_node(num_cpus=NODE_CPUS)
        ray.init(address=nodes.address, log_to_driver=False, logging_level=logging.WARNING)
        nodes.wait_for_nodes(timeout=WAIT_S)
        cfg = ClusterConfig.model_validate(
            {
                "name": f"node-loss-{os.getpid()}",
                "dashboard": False,
                "model": {"tiny_family": "llama"},
                "workers": {"num_workers": 3, "num_cpus_per_worker": 0.1},
                "router": {"port": 0, "http_port": None},
                "redis": {"heartbeat_ttl_s": 2.0},
            }
        )
        with Cluster(cfg) as cluster:
            result = run(nodes, cluster, **sizes)
    finally:
        ray.shutdown()
        nodes.shutdown()
        leave_loopback_ray()
    rows = [{"figure": k, "value": v} for k, v in result["figures"].items()]
    print_table(rows, "node loss (3 nodes: kill, join, kill)")
    if result["errors"]:
        print(f"errors: {result['errors']}")
    emit_json({"node_loss": result["figures"], "errors": result["errors"], **sizes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
