"""A router dies while it streams; clients move to the other router, workers free the blocks.

The client is given both routers' addresses (a standard gRPC multi-address target, pick_first):
its open streams fail UNAVAILABLE and the client resumes each through the surviving router after
the tokens it has, so each ends with every token; its next call goes to the survivor. The dead
router's requests have no consumer any more: the workers stop them and free their KV blocks
long before they could have finished on their own.

Every wait polls for its condition (generous deadlines: the machine may be busy); none
depends on how soon the workers' CallerWatch (a ping every 0.25 s) notices the death.
"""

from __future__ import annotations

import time

import pytest
import ray

from cluster.client import KVClusterClient, build_request
from tests.reliability.helpers import (
    CALL_TIMEOUT_S,
    blocks_in_use,
    generated_tokens,
    on_workers,
    wait_for,
    wait_idle,
)

pytestmark = [pytest.mark.ray, pytest.mark.redis]

STREAMS = 3
MAX_TOKENS = 440  # would take many seconds to finish; must be stopped, not waited out
WAIT_S = 60.0  # deadline of every condition this test waits for


def orphans_aborted(cluster) -> int:  # noqa: ANN001
    """Requests the workers aborted because their caller died (``CallerWatch.aborted``)."""
    return sum(on_workers(cluster, lambda w: w.streams.callers.aborted).values())


def test_router_kill_client_reconnects_and_orphans_are_freed(cluster) -> None:
    killed = False
    try:
        target = "ipv4:" + ",".join(cluster.endpoints)  # router-0 first (pick_first)
        with KVClusterClient(target) as client:
            assert (
                client.generate("Which router?", max_tokens=2, timeout=CALL_TIMEOUT_S).text
                is not None
            )
            tokens0, aborted0 = generated_tokens(cluster), orphans_aborted(cluster)
            calls = [
                client.stream(
                    build_request(
                        f"Orphan stream {i}. " * 3,
                        max_tokens=MAX_TOKENS,
                        temperature=0.0,
                        ignore_eos=True,
                    ),
                    timeout=CALL_TIMEOUT_S,
                )
                for i in range(STREAMS)
            ]
            streams = [iter(c) for c in calls]
            # every stream is running on a worker
            received = [list(next(s).token_ids) for s in streams]
            assert sum(blocks_in_use(cluster).values()) > 0

            ray.kill(cluster.routers["router-0"], no_restart=True)
            killed = True
            for got, s in zip(received, streams, strict=True):
                for msg in s:
                    got.extend(msg.token_ids)
            # resumed, not replayed: every token once, as an uninterrupted run has them
            whole = client.generate(
                "Orphan stream 0. " * 3,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
                timeout=CALL_TIMEOUT_S,
            )
            assert received[0] == whole.token_ids[0]
            assert [len(got) for got in received] == [MAX_TOKENS] * STREAMS

            # the same client reaches the surviving router on its next call
            after = client.generate("Still there?", max_tokens=2, timeout=CALL_TIMEOUT_S)
            assert after.completion_tokens == 2

            # the orphaned requests are stopped (aborted by the workers: a request that ran to
            # max_tokens is never aborted), not run to max_tokens, and their blocks are freed
            stopped = lambda: orphans_aborted(cluster) - aborted0  # noqa: E731
            assert wait_for(lambda: stopped() >= STREAMS, WAIT_S, 0.2), stopped()
            assert stopped() == STREAMS
            assert wait_for(lambda: sum(blocks_in_use(cluster).values()) == 0, WAIT_S, 0.2), (
                blocks_in_use(cluster)
            )
            # the orphans' tokens: all generated since, less the continuations (at most a
            # whole run each), the reference run and the last call; run out, they would be
            # about a whole run each
            full = len(whole.token_ids[0])
            served = (STREAMS + 1) * full + after.completion_tokens
            orphans = generated_tokens(cluster) - tokens0 - served
            assert orphans < STREAMS * full * 0.5, orphans
        assert wait_idle(cluster, WAIT_S)
    finally:
        # heal, pass or fail: a new router-0 for the other tests of this package
        if killed:
            del cluster.routers["router-0"]
            handle = wait_for_name_free(cluster)
            cluster.endpoints[0] = ray.get(handle.start.remote(), timeout=WAIT_S)


def test_a_dead_routers_idle_channels_are_dropped(cluster) -> None:
    """A router that dies with no request in flight leaves idle channels (long-lived Ray
    streams that yield only when outputs come) on the workers it used: the workers notice
    its death and drop them; the router started in its place is served."""
    killed = False
    try:
        with KVClusterClient(cluster.endpoints[0]) as client:
            for i in range(4):  # 4 prompts: channels to one or both workers
                # sampled: an end-of-turn token may come first, and the count is asserted
                out = client.generate(
                    f"Idle channel {i}.", max_tokens=2, ignore_eos=True, timeout=CALL_TIMEOUT_S
                )
                assert out.completion_tokens == 2
        assert wait_idle(cluster, WAIT_S)  # nothing in flight anywhere
        old = ray.get(cluster.routers["router-0"].incarnation.remote(), timeout=CALL_TIMEOUT_S)
        assert channels_of(cluster, old) >= 1

        ray.kill(cluster.routers["router-0"], no_restart=True)
        killed = True
        assert wait_for(lambda: channels_of(cluster, old) == 0, WAIT_S, 0.2), channels_of(
            cluster, old
        )
    finally:
        if killed:
            del cluster.routers["router-0"]
            handle = wait_for_name_free(cluster)
            cluster.endpoints[0] = ray.get(handle.start.remote(), timeout=WAIT_S)
    with KVClusterClient(cluster.endpoints[0]) as client:
        out = client.generate(
            "A new router.", max_tokens=2, ignore_eos=True, timeout=CALL_TIMEOUT_S
        )
        assert out.completion_tokens == 2
    new = ray.get(cluster.routers["router-0"].incarnation.remote(), timeout=CALL_TIMEOUT_S)
    assert new != old and channels_of(cluster, new) >= 1


def channels_of(cluster, incarnation: str) -> int:  # noqa: ANN001
    """Channels the workers hold for the router incarnation ``incarnation``."""
    ids = on_workers(cluster, lambda w: w.streams.channels.ids())
    return sum(cid.startswith(incarnation + "/") for cids in ids.values() for cid in cids)


def wait_for_name_free(cluster):  # noqa: ANN001, ANN201
    """Start router-0 again once Ray has released the dead actor's name."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return cluster.start_router(0)
        except ValueError:  # name still taken by the dying actor
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
