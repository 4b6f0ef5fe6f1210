"""The actors' event loops are uvloop's: Ray runs an async actor's loop on uvloop when it can
import it (a dependency), and the router's grpc.aio server, its HTTP door (httptools) and
the channels from the workers all serve on it. Fails if uvloop stops being installed or
Ray stops using it, and if a stream over either edge breaks on it. The driver's own loops
(the launcher, the clients) are asyncio's either way: Ray installs uvloop only in its
worker processes."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

import pytest
import ray

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_router_and_worker_actors_serve_on_uvloop(cluster, client) -> None:
    handles = [*cluster.routers.values(), *cluster.workers.values()]
    loops = {r["loop"] for r in ray.get([h.loop_lag.remote() for h in handles], timeout=30)}
    assert loops == {"uvloop.Loop"}

    out = client.generate("Served on uvloop.", max_tokens=12, temperature=0.0, ignore_eos=True)
    assert out.completion_tokens == 12 and out.num_messages > 1

    body = {"model": cluster.model_id, "prompt": "Served on uvloop.", "max_tokens": 12}
    body |= {"temperature": 0.0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        cluster.http_endpoints[0] + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line[:6] == "data: "]
    assert events[-1] == "[DONE]"
    text = "".join(
        json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices")
    )
    assert text == out.text


def test_every_loop_thread_asks_for_a_short_slice_and_cpu_engines_run_nicer(cluster) -> None:
    """The policy of ``cluster.scheduling`` as the kernel reports it: each actor's loop
    thread has its slice at its process's niceness, each worker's engine thread (on CPU)
    ``compute_nice`` points nicer than its process."""
    from kvstore.blocks.loop_sched import custom_slices

    cfg = cluster.cfg.scheduling
    assert cfg.enabled
    handles = [*cluster.routers.values(), *cluster.workers.values()]
    reports = ray.get([h.loop_lag.remote() for h in handles], timeout=30)
    nices = ray.get([h.__ray_call__.remote(lambda _: os.nice(0)) for h in handles], timeout=30)
    want_slice = cfg.loop_slice_ms if custom_slices() else None
    assert [r["sched"] for r in reports] == [{"slice_ms": want_slice, "nice": n} for n in nices]
    workers = reports[len(cluster.routers) :]
    engines = [r["engine_sched"]["nice"] for r in workers]
    assert engines == [min(n + cfg.compute_nice, 19) for n in nices[len(cluster.routers) :]]


def test_the_drivers_own_loops_stay_asyncios() -> None:
    async def kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert asyncio.run(kind()).startswith("asyncio")
