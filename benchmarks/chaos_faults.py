"""Faults that Ray does not report, with recovery times: a frozen worker, a killed router.

Each function injects one fault into a running cluster, measures how long the clients are
affected, heals it and returns one row (plain numbers and lists, so the reliability tests can
assert on the same runs that ``benchmarks/chaos.py`` prints).

* frozen worker: SIGSTOP a worker's actor process while it streams. After the routers' stall
  timeout its streams must move to another worker and end there (not hang until it thaws),
  new requests must be
  served by the other worker, ClusterStatus must answer and list it as stale; then SIGCONT.
* router kill: SIGKILL a router's actor process. Ray restarts it on the same port; a client's
  next call on the same channel succeeds once it is back, and the dead router's open streams
  are stopped on the workers (their KV blocks freed).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import grpc
import ray

from cluster.client import KVClusterClient, build_request
from cluster.launcher import Cluster

CALL_TIMEOUT_S = 60.0
STATUS_SETTLE_S = 10.0  # a frozen worker is listed not alive within this (a status timeout)


def actor_pid(handle: Any, timeout_s: float = 60.0) -> int:
    """The process id of a Ray actor (waits while Ray restarts it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=5)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _alive(status: Any, worker_id: str) -> bool:
    """Whether a ClusterStatus answer lists ``worker_id`` alive."""
    return any(w.worker_id == worker_id and w.alive for w in status.workers)


def _drain(call: Any, out: dict, key: int, t0: list[float]) -> None:
    """Read a stream to its end; record (code, details, seconds after t0[0])."""
    try:
        for _ in call:
            pass
        out[key] = ("OK", "", time.monotonic() - t0[0])
    except grpc.RpcError as exc:
        out[key] = (exc.code().name, exc.details() or "", time.monotonic() - t0[0])


def frozen_worker_recovery(
    cluster: Cluster,
    *,
    streams: int = 4,
    short_requests: int = 4,
    max_freeze_s: float = 30.0,
    max_tokens: int = 200,
) -> dict:
    """SIGSTOP the worker serving the first of ``streams`` open streams; see the module doc.

    Returns the row: victim, per-stream outcomes on it and elsewhere, ``streams_released_s``
    (freeze to the last of its streams ending), the short requests sent while frozen
    (worker, code, seconds), the status answer while frozen (seconds, the victim's
    stale/alive flags), ``ended_while_frozen`` and ``back_s`` (thaw to it being live again).
    """
    endpoint = cluster.endpoints[0]
    with KVClusterClient(endpoint) as client:
        calls = [
            client.stream(
                build_request(
                    f"Frozen-worker stream {i}: count slowly. " * 3,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                ),
                timeout=CALL_TIMEOUT_S,
            )
            for i in range(streams)
        ]
        iters = [iter(c) for c in calls]
        placed = [next(s).worker_id for s in iters]  # each stream is running somewhere
        victim = placed[0]
        pid = actor_pid(cluster.workers[victim])
        t0 = [time.monotonic()]
        os.kill(pid, signal.SIGSTOP)
        try:
            ends: dict[int, tuple] = {}
            readers = [
                threading.Thread(target=_drain, args=(s, ends, i, t0), daemon=True)
                for i, s in enumerate(iters)
            ]
            for r in readers:
                r.start()
            shorts = []
            for i in range(short_requests):
                t = time.monotonic()
                try:
                    out = client.generate(
                        f"While frozen {i}.", max_tokens=2, timeout=CALL_TIMEOUT_S
                    )
                    shorts.append((out.worker_id, "OK", time.monotonic() - t))
                except grpc.RpcError as exc:
                    shorts.append(("", exc.code().name, time.monotonic() - t))
            t = time.monotonic()
            status = client.status()
            # a router shares one round of status calls among callers for a moment, and a
            # round begun before the freeze (a client's address refresh) still heard the
            # victim: ask again until an answer no older than the freeze lists it not alive
            while time.monotonic() - t < STATUS_SETTLE_S and _alive(status, victim):
                time.sleep(0.2)
                status = client.status()
            status_s = time.monotonic() - t
            mine = [i for i, w in enumerate(placed) if w == victim]
            deadline = t0[0] + max_freeze_s
            while time.monotonic() < deadline and not all(i in ends for i in mine):
                time.sleep(0.05)
            ended_while_frozen = all(i in ends for i in mine)
        finally:
            os.kill(pid, signal.SIGCONT)
        t_thaw = time.monotonic()
        for r in readers:
            r.join(CALL_TIMEOUT_S)
        back_s = None
        while time.monotonic() - t_thaw < 60:
            w = {s.worker_id: s for s in client.status().workers}.get(victim)
            if w is not None and w.alive and not w.stale:
                back_s = time.monotonic() - t_thaw
                break
            time.sleep(0.2)
    seen = {s.worker_id: s for s in status.workers}.get(victim)
    return {
        "victim": victim,
        "victim_streams": [ends.get(i) for i in mine],
        "other_streams": [ends.get(i) for i, w in enumerate(placed) if w != victim],
        "streams_released_s": max((ends[i][2] for i in mine if i in ends), default=None),
        "ended_while_frozen": ended_while_frozen,
        "short_requests": shorts,
        "status_s": status_s,
        "status_listed_victim": seen is not None,
        "status_victim_stale": bool(seen and seen.stale),
        "status_victim_alive": bool(seen and seen.alive),
        "back_s": back_s,
    }


def router_kill_recovery(
    cluster: Cluster, router: str = "router-1", *, max_tokens: int = 400, max_wait_s: float = 90.0
) -> dict:
    """SIGKILL ``router``'s process while a stream runs through it; see the module doc.

    Returns the row: the open stream's code, ``recovery_s`` (kill to the first successful
    call on the same client; failed attempts in between), whether the port and the process
    changed, and ``orphans_freed`` (the stream's request stopped on its worker).
    """
    i = int(router.rsplit("-", 1)[1])
    endpoint = cluster.endpoints[i]
    # the open stream's client does not retry (with retries it would resume the stream once
    # the router is back); the other one's calls retry through the restart
    with KVClusterClient(endpoint, retries=0) as streamer, KVClusterClient(endpoint) as client:
        client.generate("Before the router dies.", max_tokens=2, timeout=CALL_TIMEOUT_S)
        call = streamer.stream(
            build_request(
                "An orphan of the dying router. " * 3,
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
            ),
            timeout=CALL_TIMEOUT_S,
        )
        stream = iter(call)
        first = next(stream)
        pid = actor_pid(cluster.routers[router])
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        ends: dict[int, tuple] = {}
        _drain(stream, ends, 0, [t0])
        attempts, recovery_s, last_error = 0, None, ""
        while time.monotonic() - t0 < max_wait_s:
            attempts += 1
            try:
                client.generate("After the router came back.", max_tokens=2, timeout=5)
                recovery_s = time.monotonic() - t0
                break
            except grpc.RpcError as exc:
                last_error = f"{exc.code().name}: {exc.details()}"
                time.sleep(0.2)
    new_pid = actor_pid(cluster.routers[router])
    orphan_worker = first.worker_id
    freed = _wait(lambda: _blocks(cluster, orphan_worker) == 0, 20)
    return {
        "router": router,
        "open_stream": ends[0][:2],
        "recovery_s": recovery_s,
        "attempts": attempts,
        "last_error": last_error,
        "restarted": new_pid != pid,
        "same_endpoint": cluster.endpoints[i] == endpoint,
        "orphans_freed": freed,
    }


def _blocks(cluster: Cluster, worker: str) -> int:
    h = cluster.workers[worker]
    return ray.get(h.kv_blocks_in_use.remote(), timeout=30)


def _wait(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())
