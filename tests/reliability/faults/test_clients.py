"""Clients that go away: disconnects, cancels at every stage, deadlines while queued.

Whatever ends a stream early, the worker aborts the request and frees its KV blocks; a
request still waiting in a worker's queue is removed from it.
"""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from cluster.client import KVClusterClient, build_request
from tests.reliability.helpers import (
    CALL_TIMEOUT_S,
    blocks_in_use,
    engines_held,
    generated_tokens,
    queued,
    wait_for,
    wait_idle,
)

pytestmark = [pytest.mark.ray, pytest.mark.redis]


LONG = 440  # a prompt of about 60 tokens leaves 450 of the tiny model's 512


def _long(i: int, max_tokens: int = 300) -> object:
    return build_request(
        f"Long story number {i}, told slowly. " * 3,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    )


def test_disconnect_mid_stream_aborts_on_the_worker(cluster) -> None:
    tokens0 = generated_tokens(cluster)
    channels = [KVClusterClient(cluster.endpoints[i % 2]) for i in range(4)]
    calls = [c.stream(_long(i, LONG), timeout=CALL_TIMEOUT_S) for i, c in enumerate(channels)]
    for call in calls:  # kept referenced: a collected call object would cancel itself
        next(call)
    assert sum(blocks_in_use(cluster).values()) > 0
    for c in channels:
        c.close()  # the connection goes away; no cancel message from the application
    assert wait_for(lambda: sum(blocks_in_use(cluster).values()) == 0, 30, 0.2)
    assert generated_tokens(cluster) - tokens0 < 4 * LONG * 0.9  # stopped, not finished
    assert wait_idle(cluster)


def test_cancels_at_every_stage_and_deadline_while_queued(cluster, client) -> None:
    rng = random.Random(7)
    calls = [client.stream(_long(i), timeout=CALL_TIMEOUT_S) for i in range(16)]
    # 16 streams, 4 run per worker: the rest wait in the workers' queues
    assert wait_for(lambda: sum(w for _, w in queued(cluster).values()) > 0, 20)
    # a request that waits on its worker past its deadline: the engines are held while it
    # is sent (a slot that frees, or a fast machine, would otherwise let it finish in time)
    with KVClusterClient(cluster.endpoints[1]) as other, engines_held(cluster):
        try:
            other.generate("Queued behind the others.", max_tokens=50, timeout=0.3)
            late = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            late = exc.code()
    assert late == grpc.StatusCode.DEADLINE_EXCEEDED

    def cancel(call: grpc.Future, keep: int) -> None:
        """Cancel after ``keep`` messages (0: at once, maybe still queued on its worker)."""
        for got, _ in enumerate(call if keep else (), start=1):
            if got >= keep:
                break
        call.cancel()

    threads = [threading.Thread(target=cancel, args=(c, rng.randint(0, 4))) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    assert wait_idle(cluster), (blocks_in_use(cluster), queued(cluster))
