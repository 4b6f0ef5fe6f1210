"""Helpers of the reliability suite. The probes into live workers and routers and the mixed
load live in :mod:`benchmarks.chaos_probes` and :mod:`benchmarks.chaos_load` (the chaos run
uses them too); this module adds what only tests need. Every gRPC call of the suite carries
a deadline: a hang fails a test."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from benchmarks.chaos_load import MixedLoad  # noqa: F401 - re-exported for the tests
from benchmarks.chaos_probes import (  # noqa: F401 - re-exported for the tests
    NON_UTF8_TEXT,
    blocks_in_use,
    decisions,
    on_workers,
    queued,
    raw_generate,
    raw_string_field,
    retries,
    router_stats,
    wait_idle,
    worker_rss,
)
from cluster.client import KVClusterClient
from worker.engine.commands import Metrics

CALL_TIMEOUT_S = 60.0  # deadline of every gRPC call of the suite
# a worker process Ray restarts imports torch and loads its model again: on a loaded 2-core
# machine (two CPU burners beside the suite) that took up to ~150 s, the same as a cluster's start
RESTART_TIMEOUT_S = 240.0
HOLD_MAX_S = 30.0  # an engine held by a test runs again after this long, whatever the test does


def wait_for(
    predicate: Callable[[], Any], timeout_s: float = 15.0, interval_s: float = 0.1
) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def generated_tokens(cluster: Any) -> int:
    """Tokens sampled by all workers since they (re)started."""
    return sum(
        on_workers(cluster, lambda w: w.engine_loop.call(Metrics()).generation_tokens).values()
    )


def code_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """Run one call; its status code and details (OK, "" on success)."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def generate_code(
    client: KVClusterClient, prompt: Any, **kwargs: Any
) -> tuple[grpc.StatusCode, str]:
    return code_of(lambda: client.generate(prompt, timeout=CALL_TIMEOUT_S, **kwargs))


def health_report(cluster: Any) -> dict[str, Any]:
    """What a failing fault test prints: each router's view of the workers and Ray's view of
    the worker actors (state, restarts, death cause)."""
    report: dict[str, Any] = {}
    for i, endpoint in enumerate(cluster.endpoints):
        try:
            with KVClusterClient(endpoint) as client:
                report[f"router-{i}"] = [
                    (w.worker_id, w.epoch, w.alive, w.stale, round(w.heartbeat_age_s, 1))
                    for w in client.status().workers
                ]
        except grpc.RpcError as exc:
            report[f"router-{i}"] = f"{exc.code().name}: {exc.details()}"
    try:
        from ray.util.state import list_actors

        report["actors"] = [
            (a.name, a.state, a.num_restarts, (a.death_cause or {}) and str(a.death_cause)[:300])
            for a in list_actors(detail=True, timeout=10)
            if a.name
        ]
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the state API needs the dashboard
        report["actors"] = f"unavailable: {exc!r}"[:300]
    return report


def wait_workers_alive(cluster: Any, timeout_s: float = RESTART_TIMEOUT_S) -> None:
    """Every configured worker is live for every router, or fail with the health report."""

    def all_alive() -> bool:
        for endpoint in cluster.endpoints:
            with KVClusterClient(endpoint) as client:
                alive = {w.worker_id for w in client.status().workers if w.alive}
            if not set(cluster.workers) <= alive:
                return False
        return True

    if not wait_for(all_alive, timeout_s, 0.5):
        raise AssertionError(f"workers not all live: {health_report(cluster)}")


@contextmanager
def engines_held(cluster: Any) -> Iterator[None]:
    """Every worker's engine loop parked between two steps (``EngineLoop.paused``) while the
    block runs: no request makes progress and a new one waits in its worker's inbox, however
    slow the machine is. Probes into the engine (:func:`queued`, :func:`blocks_in_use`) would
    wait for the block's end: call none inside it. The actors' asyncio loops keep answering
    (routers' liveness probes), so a hold of a few seconds kills no worker."""

    def hold(server: Any) -> bool:
        parked, release = threading.Event(), threading.Event()

        def park() -> None:
            with server.engine_loop.paused():
                parked.set()
                release.wait(HOLD_MAX_S)

        threading.Thread(target=park, name="test-hold", daemon=True).start()
        server.test_hold_release = release  # for let_go, on a later call
        return parked.wait(HOLD_MAX_S)

    def let_go(server: Any) -> None:
        server.test_hold_release.set()

    try:
        assert all(on_workers(cluster, hold).values()), "an engine did not park"
        yield
    finally:
        on_workers(cluster, let_go)
