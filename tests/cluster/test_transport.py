"""Outputs between workers and routers: one channel per (router, worker) carrying each step's
outputs for all of the router's requests, split into per-request streams at the router; a
reader that lags gets what gathered meanwhile as one output, with every token in order."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import grpc
import pytest
import ray

from cluster.client import build_request
from kvstore.requests.errors import InvalidRequest
from kvstore.requests.outputs import GenerationResult
from kvstore.requests.protocol import Admitted, WorkerRequest
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc
from router.serving.ray_workers import RayWorkerDirectory
from router.serving.worker_call_errors import call_result
from router.serving.worker_channel import WAKE_SLICE
from router.serving.workers import WorkerGone
from tests.cluster.conftest import ENGINE
from worker.engine import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.redis]
PROMPT = [11, 42, 7, 99, 23, 5, 61, 17, 88, 3, 14, 15, 92, 65, 35, 89, 79, 32]


async def read(directory: RayWorkerDirectory, worker: str, params: SamplingParams, *, lag_s: float):
    """One request straight through the directory; after the first output the reader
    pauses ``lag_s`` (the engine runs on). Returns the outputs read after Admitted."""
    request = WorkerRequest(uuid.uuid4().hex, PROMPT, params, False)
    outs = []
    async for item in directory.stream(worker, request):
        if isinstance(item, Admitted):
            continue
        outs.append(item)
        if len(outs) == 1 and lag_s:
            await asyncio.sleep(lag_s)
    return outs


def result_of(outs) -> GenerationResult:  # noqa: ANN001
    res = GenerationResult("", [])
    for out in outs:
        res.add(out)
    return res


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, beam_width=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[7]),
    ],
    ids=["n3-logprobs", "beams", "stop"],
)
def test_a_lagging_reader_gets_every_token_coalesced(cluster, params) -> None:
    worker = sorted(cluster.workers)[0]

    async def main():
        directory = RayWorkerDirectory(cluster.namespace, None)
        try:
            fast = await read(directory, worker, params, lag_s=0)
            slow = await read(directory, worker, params, lag_s=3.0)
            return fast, slow, directory.channels.get(worker).messages
        finally:
            directory.channels.close()

    fast, slow, messages = asyncio.run(main())
    want, got = result_of(fast), result_of(slow)
    # the same tokens, text and endings in the same order (logprobs to float noise: the
    # second run's prompt comes from the prefix cache, in another batch)
    assert [
        (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in got.completions
    ] == [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in want.completions]
    assert got.usage.completion_tokens == want.usage.completion_tokens
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in got.completions)
    for g, w in zip(got.completions, want.completions, strict=True):
        if w.logprobs is not None:
            assert [lp.token_id for lp in g.logprobs] == g.token_ids
            assert [lp.logprob for lp in g.logprobs] == pytest.approx(
                [lp.logprob for lp in w.logprobs], abs=1e-4
            )
            assert [len(lp.top) for lp in g.logprobs] == [2] * len(g.token_ids)
    assert slow[-1].finished and not any(o.finished for o in slow[:-1])
    if params.use_beam_search:
        return  # beams report once, at the end: nothing to coalesce
    # what the engine made during the pause came as one output
    assert len(slow) <= 3 < len(fast)
    assert messages >= 2


def test_one_channel_carries_every_request_of_a_step(cluster) -> None:
    worker = sorted(cluster.workers)[1]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def main():
        directory = RayWorkerDirectory(cluster.namespace, None)
        try:
            runs = await asyncio.gather(
                *(read(directory, worker, params, lag_s=0) for _ in range(8))
            )
            return runs, directory.channels.get(worker).messages
        finally:
            directory.channels.close()

    runs, messages = asyncio.run(main())
    outputs = sum(len(r) for r in runs)
    assert all(sum(len(d.token_ids) for o in r for d in o.outputs) == 24 for r in runs)
    assert messages < outputs / 2  # batched per step, not one message per request output


def test_a_client_that_stops_reading_holds_up_nobody(cluster, client) -> None:
    """A gRPC stream left unread while others run: they finish, and it still gets all of
    its tokens once read."""
    with grpc.insecure_channel(cluster.endpoints[0]) as channel:
        stub = pb_grpc.KVClusterStub(channel)
        stalled = stub.Generate(
            build_request(PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=5),
            timeout=120,
        )
        first = next(stalled)
        done = threading.Event()

        def others() -> None:
            for i in range(4):
                out = client.generate([3 + i, *PROMPT], max_tokens=16, ignore_eos=True, timeout=60)
                assert out.completion_tokens == 16
            done.set()

        t = threading.Thread(target=others)
        t.start()
        t.join(120)
        assert done.is_set()
        rest = list(stalled)
    tokens = list(first.token_ids) + [t for m in rest for t in m.token_ids]
    assert len(tokens) == 200
    assert sum(len(m.logprobs) for m in [first, *rest]) == 200
    assert rest[-1].usage.completion_tokens == 200


def test_closing_a_channel_ends_it_on_the_worker(cluster) -> None:
    """A router that stops (its channels closed) leaves no channel and no request running
    on the worker."""
    worker = sorted(cluster.workers)[0]
    handle = cluster.workers[worker]
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    def channels_there(channel_id: str) -> bool:
        return ray.get(
            handle.__ray_call__.remote(lambda w: w.streams.channels.find(channel_id) is not None),
            timeout=30,
        )

    async def main() -> tuple[str, str]:
        directory = RayWorkerDirectory(cluster.namespace, None)
        request = WorkerRequest(uuid.uuid4().hex, PROMPT, params, False)
        stream = directory.stream(worker, request)
        async for item in stream:
            if not isinstance(item, Admitted):
                break
        channel_id = directory.channels.get(worker).channel_id
        assert channels_there(channel_id)
        directory.channels.close()  # no abort sent: the worker's side must notice
        await stream.aclose()
        return channel_id, request.request_id

    def running(rid: str) -> bool:
        return ray.get(handle.__ray_call__.remote(lambda w: rid in w.engine.requests), timeout=30)

    channel_id, rid = asyncio.run(main())
    # The abort goes through the engine's intake queue, drained between steps: the request
    # leaves the engine a step after its channel leaves the worker.
    for _ in range(100):
        if not channels_there(channel_id) and not running(rid):
            break
        time.sleep(0.1)
    assert not channels_there(channel_id)
    assert not running(rid)


def test_a_burst_for_one_worker_goes_in_one_call_each_request_answered_alone(cluster) -> None:
    """Requests placed on one worker in the same loop turn go in one Ray call, not one
    each; a refused one (its own InvalidRequest, in its place) refuses no other."""
    worker = sorted(cluster.workers)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    too_wide = SamplingParams(max_tokens=3, n=ENGINE["max_num_seqs"] + 1)
    burst = 24  # under the engine's max_waiting: none is refused as an overload
    assert burst < WAKE_SLICE  # one loop turn's slice

    async def main() -> tuple:
        directory = RayWorkerDirectory(cluster.namespace, None)
        try:
            await read(directory, worker, params, lag_s=0)  # the handle and the channel
            calls = directory.submits.calls
            runs = await asyncio.gather(
                *(read(directory, worker, params, lag_s=0) for _ in range(burst // 2)),
                read(directory, worker, too_wide, lag_s=0),
                *(read(directory, worker, params, lag_s=0) for _ in range(burst // 2)),
                return_exceptions=True,
            )
            return runs, directory.submits.calls - calls, directory.submits.requests
        finally:
            directory.channels.close()

    runs, calls, requests = asyncio.run(main())
    refused = runs.pop(burst // 2)
    assert isinstance(refused, InvalidRequest) and refused.field == "n", refused
    assert all(sum(len(d.token_ids) for o in r for d in o.outputs) == 3 for r in runs), runs
    assert calls == 1, f"{calls} submit calls for a burst of {burst + 1} requests"
    assert requests == 1 + burst + 1


@ray.remote(num_cpus=0)
class Caller:
    """A router stand-in that workers can watch: it answers with its incarnation."""

    def __init__(self, incarnation: str) -> None:
        self._incarnation = incarnation

    def set(self, incarnation: str) -> None:
        self._incarnation = incarnation

    def incarnation(self) -> str:
        return self._incarnation


def test_a_worker_is_looked_up_once_and_gets_the_caller_once_per_channel(cluster) -> None:
    """Concurrent first requests share one name lookup (off the loop); the caller (an
    actor handle, costly to unpickle) rides with the channel's first request only, the
    worker keeps it and watches it; a worker marked dead is looked up again."""
    worker = sorted(cluster.workers)[0]
    handle = cluster.workers[worker]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    stand_in = Caller.remote("")

    def kept_caller(channel_id: str) -> str | None:
        return ray.get(
            handle.__ray_call__.remote(
                lambda w: getattr(w.streams.channels.find(channel_id).caller, "incarnation", None)
            ),
            timeout=30,
        )

    async def main() -> tuple:
        directory = RayWorkerDirectory(cluster.namespace, None, caller_actor=stand_in)
        await stand_in.set.remote(directory.incarnation)
        try:
            first = await asyncio.gather(
                *(read(directory, worker, params, lag_s=0) for _ in range(4))
            )
            ch = directory.channels.get(worker)
            sent_at_first = ch.callers_sent
            later = [await read(directory, worker, params, lag_s=0) for _ in range(4)]
            kept = kept_caller(ch.channel_id)
            lookups = directory.lookups
            directory.mark_dead(worker)
            await read(directory, worker, params, lag_s=0)
            return first + later, sent_at_first, ch.callers_sent, kept, lookups, directory
        finally:
            directory.channels.close()

    runs, sent_at_first, sent, kept, lookups, directory = asyncio.run(main())
    assert all(sum(len(d.token_ids) for o in r for d in o.outputs) == 6 for r in runs)
    assert lookups == 1 and directory.lookups == 2
    assert sent_at_first == 4 and sent == 4  # the concurrent first ones; none after
    assert kept == directory.incarnation


def test_a_request_naming_a_channel_the_worker_lost_is_refused_as_a_gone_worker(
    cluster,
) -> None:
    """A worker restarted since the router opened its channel has no caller for it: a
    request that names only the caller's id is refused, so the router reopens the channel."""
    worker = sorted(cluster.workers)[0]
    request = WorkerRequest(uuid.uuid4().hex, PROMPT, SamplingParams(max_tokens=4), False)
    ref = cluster.workers[worker].submit.remote(request, "some-router", "no/such/channel")
    with pytest.raises(WorkerGone, match="is not open on this worker"):
        asyncio.run(call_result(ref))
