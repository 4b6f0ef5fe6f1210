"""Redis freezes (SIGSTOP: connections open, nothing answers) and thaws.

A frozen Redis is worse than a dead one: every read waits out its socket timeout. The
routers' circuit breaker pays that once per probe interval, not once per request: requests
keep flowing by load at close to normal latency (compared with the same client's rate just
before the freeze), and when Redis thaws the first probe closes the circuit.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.reliability.helpers import generate_code, router_stats, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.redis]

WINDOW_S = 4.0  # each measurement window (normal, then frozen)


def _served(client, tag: str, seconds: float) -> list:  # noqa: ANN001
    codes, end, i = [], time.monotonic() + seconds, 0
    while time.monotonic() < end:
        codes.append(generate_code(client, f"{tag} request {i}: how are you?", max_tokens=1)[0])
        i += 1
    return codes


def test_frozen_redis_is_skipped_by_the_breaker_and_probed_back(cluster, client) -> None:
    router = "router-0"  # client's router
    probe_s = cluster.cfg.router.routing.index_probe_interval_s
    normal = _served(client, "normal", WINDOW_S)
    before = router_stats(cluster)[router]
    pid = cluster.redis.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen = _served(client, "frozen", WINDOW_S)
        during = router_stats(cluster)[router]
    finally:
        os.kill(pid, signal.SIGCONT)
    ok = type(normal[0]).OK
    assert set(normal) == {ok} and set(frozen) == {ok}, frozen
    # every request served, at close to the normal rate (without the breaker each one waited
    # out Redis timeouts: a handful in the window instead of dozens)
    assert len(frozen) >= 0.3 * len(normal), (len(normal), len(frozen))
    # Redis was asked about once per probe interval, not once per request
    failed = during["index_failures"] - before["index_failures"]
    assert 1 <= failed <= WINDOW_S / probe_s + 2, failed
    assert during["index_skipped"] > before["index_skipped"]
    assert during["index_circuit_open"] and not during["index_available"]

    # thawed: the next probe succeeds and closes the circuit
    def closed() -> bool:
        generate_code(client, "after the thaw", max_tokens=1)
        st = router_stats(cluster)[router]
        return not st["index_circuit_open"] and st["index_available"]

    assert wait_for(closed, timeout_s=10 * probe_s + 10, interval_s=0.2)
