"""Probes into a live cluster (through Ray: workers' block counts, queues, memory; routers'
stats and decisions) and raw requests that a protobuf client library would refuse to build.
The chaos run and the reliability tests use both."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import ray
from ray.exceptions import ActorUnavailableError

from cluster.launcher import Cluster
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from worker.engine.commands import Snapshot

# -- raw requests (bytes that a protobuf client library would refuse to build) ---------------


def raw_string_field(number: int, raw: bytes) -> bytes:
    """A length-delimited field holding arbitrary bytes (e.g. non-UTF-8 in a string field)."""
    return _varint(number << 3 | 2) + _varint(len(raw)) + raw


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def raw_generate(
    channel: grpc.Channel, data: bytes, *, metadata: Any = None, timeout: float = 60.0
) -> list[pb.GenerateResponse]:
    """Generate with ``data`` sent as the request bytes (no client-side serialization)."""
    call = channel.unary_stream(
        "/kvcluster.v1.KVCluster/Generate",
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    return list(call(data, timeout=timeout, metadata=metadata))


NON_UTF8_TEXT = raw_string_field(2, b"caf\xe9 \xff\xfe")  # GenerateRequest.text, Latin-1 bytes


# -- probes into a live cluster (through Ray) --------------------------------------------------


def on_workers(
    cluster: Cluster, fn: Callable[[Any], Any], timeout_s: float = 90.0
) -> dict[str, Any]:
    """``fn(worker_server)`` on every worker actor; a restarting one is waited for."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, Any] = {}
    for name in sorted(cluster.workers):
        while True:
            try:
                out[name] = ray.get(
                    cluster.workers[name].__ray_call__.remote(fn),
                    timeout=max(1.0, deadline - time.monotonic()),
                )
                break
            except ActorUnavailableError:  # Ray is restarting it
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return out


def blocks_in_use(cluster: Cluster) -> dict[str, int]:
    return on_workers(cluster, lambda w: w.engine_loop.call(Snapshot()).kv_used_blocks)


def queued(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """worker -> (running, waiting) requests."""

    def counts(w: Any) -> tuple[int, int]:
        snap = w.engine_loop.call(Snapshot())
        return snap.num_running, snap.num_waiting

    return on_workers(cluster, counts)


def worker_rss(cluster: Cluster) -> dict[str, int]:
    """Resident set size of every worker process in bytes (Linux ``/proc``)."""

    def rss(_: Any) -> int:

        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    return on_workers(cluster, rss)


def router_stats(cluster: Cluster) -> dict[str, dict]:
    return {name: ray.get(h.stats.remote(), timeout=30) for name, h in cluster.routers.items()}


def decisions(cluster: Cluster) -> Counter[str]:
    """Routing decisions of all routers by reason (prefix, load, no-index, ...)."""
    out: Counter[str] = Counter()
    for stats in router_stats(cluster).values():
        for label, n in stats["decisions"].items():
            out[label.split("/", 1)[1]] += n
    return out


def retries(cluster: Cluster) -> int:
    """Requests the routers moved to another worker after a death before any token."""
    return sum(s["retries"] for s in router_stats(cluster).values())


def wait_idle(cluster: Cluster, timeout_s: float = 20.0) -> bool:
    """Wait until no worker runs, queues or holds anything for a request."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not any(blocks_in_use(cluster).values()) and all(
            q == (0, 0) for q in queued(cluster).values()
        ):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
