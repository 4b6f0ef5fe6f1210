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
from dataclasses import replace

import pytest
import ray

from kvstore.blocks.loop_sched import ThreadSchedConfig, custom_slices, thread_sched
from router.server import RouterActor
from worker.actor import WorkerActor

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


def test_by_default_every_thread_runs_as_the_kernel_starts_it(cluster) -> None:
    """``cluster.scheduling`` is off unless enabled: each actor's loop thread and each
    worker's engine thread report the kernel's own slice at their process's niceness."""
    assert not cluster.cfg.scheduling.enabled
    handles = [*cluster.routers.values(), *cluster.workers.values()]
    reports = ray.get([h.loop_lag.remote() for h in handles], timeout=30)
    nices = ray.get([h.__ray_call__.remote(lambda _: os.nice(0)) for h in handles], timeout=30)
    default = thread_sched()["slice_ms"]  # this driver's thread: the kernel's default
    assert [r["sched"] for r in reports] == [{"slice_ms": default, "nice": n} for n in nices]
    engines = [r["engine_sched"] for r in reports[len(cluster.routers) :]]
    assert engines == [{"slice_ms": default, "nice": n} for n in nices[len(cluster.routers) :]]


def test_enabled_the_loop_threads_get_short_slices_and_cpu_engines_run_nicer(cluster) -> None:
    """A worker and a router beside the cluster's (no index: nobody routes to them) with
    the policy on: their loop threads run with the slice at their process's niceness, the
    worker's engine thread ``compute_nice`` points nicer."""
    on = ThreadSchedConfig(enabled=True, compute_nice=3)
    ns = f"sched-{os.getpid()}"
    worker = WorkerActor.options(name="worker-sched", namespace=ns, max_concurrency=100).remote(
        replace(cluster.worker_settings("worker-sched"), index=None, sched=on)
    )
    router = RouterActor.options(name="router-sched", namespace=ns).remote(
        replace(cluster.router_settings(9), index=None, namespace=ns, sched=on)
    )
    try:
        ray.get([worker.ready.remote(), router.start.remote()], timeout=120)
        w, r = ray.get([worker.loop_lag.remote(), router.loop_lag.remote()], timeout=30)
        nice_w, nice_r = ray.get(
            [h.__ray_call__.remote(lambda _: os.nice(0)) for h in (worker, router)], timeout=30
        )
        want = on.loop_slice_ms if custom_slices() else None
        assert w["sched"] == {"slice_ms": want, "nice": nice_w}
        assert r["sched"] == {"slice_ms": want, "nice": nice_r}
        assert w["engine_sched"]["nice"] == min(nice_w + 3, 19)
    finally:
        for h in (worker, router):
            ray.kill(h)


def test_the_drivers_own_loops_stay_asyncios() -> None:
    async def kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert asyncio.run(kind()).startswith("asyncio")
