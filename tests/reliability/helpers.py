"""Helpers of the reliability suite. The probes into live workers and routers and the mixed
load live in :mod:`benchmarks.chaos` (the chaos run uses them too); this module adds what
only tests need. Every gRPC call of the suite carries a deadline: a hang fails a test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from benchmarks.chaos import (  # noqa: F401 - re-exported for the tests
    NON_UTF8_TEXT,
    MixedLoad,
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

CALL_TIMEOUT_S = 60.0  # deadline of every gRPC call of the suite


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
    return sum(on_workers(cluster, lambda w: w.front.metrics().generation_tokens).values())


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
