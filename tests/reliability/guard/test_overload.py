"""Overload: bounded queues answer RESOURCE_EXHAUSTED at once (after trying every worker),
deadlines are honoured while queued, and nothing is left behind.

Each worker of this cluster runs 2 sequences and queues 2 more: 8 requests fit.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import pytest

from tests.reliability.guard.conftest import connect
from tests.reliability.helpers import CALL_TIMEOUT_S, code_of, wait_idle

pytestmark = [pytest.mark.ray, pytest.mark.redis]

BURST = 20
CAPACITY = 2 * (2 + 2)  # workers x (running + waiting)


def test_full_queues_answer_resource_exhausted(secure, tls) -> None:
    results: list = []
    with connect(secure, tls, "alice") as client:

        def send(i: int) -> None:
            t0 = time.monotonic()
            code, details = code_of(
                lambda: client.generate(
                    f"Burst request {i}",
                    max_tokens=150,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=CALL_TIMEOUT_S,
                )
            )
            results.append((code, details, time.monotonic() - t0))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(BURST)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CALL_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in threads)
        codes = Counter(code for code, _, _ in results)
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= BURST - CAPACITY - 2, codes
        assert codes[grpc.StatusCode.OK] >= CAPACITY // 2, codes
        for code, details, _ in results:
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # both workers were tried (or were full moments ago, and the request was
                # refused unread); the message says which limit on which worker
                assert (
                    "every worker tried has a full queue" in details
                    or "every worker's queue was full moments ago" in details
                ), details
                assert "max_waiting=2" in details
                assert "worker-0" in details and "worker-1" in details
        # refused requests are answered at once, not after the others finished
        fast = [s for code, _, s in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        slow = [s for code, _, s in results if code == grpc.StatusCode.OK]
        assert max(fast) < max(slow)
        assert (
            client.generate(
                "After the burst.", max_tokens=2, timeout=CALL_TIMEOUT_S
            ).completion_tokens
            == 2
        )
    assert wait_idle(secure)
