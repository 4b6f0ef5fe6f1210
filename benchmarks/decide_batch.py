"""A burst's placements on the router's decide thread: one by one (a thread-pool future and
an index round trip per request, the answer's own loop wake-up) vs taken together
(:class:`router.serving.deciding.DecideThread`: one pipelined index read per batch, one
hand-off to the loop per batch), same router, same index, same bursts, in one run.

    python -m benchmarks.decide_batch            # 20 bursts of 256
    python -m benchmarks.decide_batch --smoke    # 3 bursts of 32

A real ``redis-server`` (started locally) holds an index of 4 workers, one of which holds
each burst's shared prefix; every request of a burst (a 1,024-token prompt: the shared
prefix and its own tail) is placed by ``ServingCore``'s placement, so the policy, the own-work
accounting and the pending placements all run; a burst reaches placement as the intake lets
it through (a slice per loop iteration). Reported: CPU per placement of this process
(the loop, the decide thread, the Redis client: everything a router spends on it), wall time
per burst, batches per burst; the decisions of both ways are checked equal. Table, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import emit_json, print_table
from cluster.local_redis import LocalRedis
from kvstore.blocks.events import BlockStored
from kvstore.blocks.hashing import HashContext, block_keys
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from kvstore.types import WorkerLoad
from router.placement.config import RoutingConfig
from router.placement.placement_types import RouteRequest
from router.placement.prefix_source import KVIndexSource
from router.placement.router import Router
from router.serving.core import ServingCore
from router.serving.edge_intake import INTAKE_SLICE
from router.serving.iteration_slices import IterationSlices
from router.serving.limits import ModelLimits

WORKERS = 4
BLOCK = 16
CTX = HashContext("bench")


def make_core(index: KVIndex) -> ServingCore:
    router = Router(RoutingConfig(policy="prefix_affinity"), KVIndexSource(index), block_size=BLOCK)
    limits = ModelLimits("bench", vocab_size=32000, max_model_len=4096, max_prompt_tokens=4095)
    return ServingCore(router, None, limits)  # type: ignore[arg-type] - placement only


def bursts(n: int, size: int, prompt: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shared = [rng.randrange(5, 32000) for _ in range(prompt - 64)]
        out.append([shared + [rng.randrange(5, 32000) for _ in range(64)] for _ in range(size)])
    return out


async def place_burst(core: ServingCore, prompts: list[list[int]], batched: bool, pool) -> list:
    loads = {f"w{i}": WorkerLoad(0, 0, 1000, 1000, 0) for i in range(WORKERS)}
    loop = asyncio.get_running_loop()
    turns = IterationSlices(INTAKE_SLICE)

    async def one(i: int, p: list[int]) -> str:
        await turns.enter()  # as the intake lets a burst through: a slice per iteration
        req = RouteRequest(f"r{i}", p, CTX)
        if batched:
            return (await core._decide.place(req, loads)).worker_id
        return (await loop.run_in_executor(pool, core._place, req, loads)).worker_id

    chosen = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    for i, w in enumerate(chosen):  # the burst's streams end (each of them counted until then)
        core.own.prefilled(w, f"r{i}", done=True)
    return chosen


def measure(index: KVIndex, all_bursts: list, batched: bool) -> tuple[dict, list]:
    core = make_core(index)
    pool = ThreadPoolExecutor(1, thread_name_prefix="route")  # the one-by-one way's thread
    chosen: list = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for prompts in all_bursts:
        chosen.append(asyncio.run(place_burst(core, prompts, batched, pool)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = sum(len(b) for b in all_bursts)
    batches = core._decide.batches if batched else n
    core.close()
    pool.shutdown()
    return {
        "way": "together" if batched else "one by one",
        "cpu us/placement": 1e6 * cpu / n,
        "wall ms/burst": 1e3 * wall / len(all_bursts),
        "batches/burst": batches / len(all_bursts),
    }, chosen


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.bursts, args.size, args.prompt = 3, 32, 256
    all_bursts = bursts(args.bursts, args.size, args.prompt, 0)
    with LocalRedis() as server:
        index = KVIndex(IndexConfig(url=server.url, model_id="bench", heartbeat_ttl_s=3600.0))
        epochs = {f"w{i}": index.register(f"w{i}") for i in range(WORKERS)}
        for b, prompts in enumerate(all_bursts):  # the shared prefix lives on one worker
            w = f"w{b % WORKERS}"
            keys = block_keys(prompts[0][: args.prompt - 64], BLOCK, CTX)
            index.apply_events(
                w, epochs[w], b // WORKERS + 1, [BlockStored(0, tuple(keys), None, (), BLOCK)]
            )
        measure(index, all_bursts[:1], True)  # warm-up: scripts loaded, code paths hot
        rows, chosen = [], []
        for batched in (False, True, False, True):  # interleaved: a load spike hits both
            row, picks = measure(index, all_bursts, batched)
            rows.append(row)
            chosen.append(picks)
        index.close()
    assert all(c == chosen[0] for c in chosen), "the two ways placed the bursts differently"
    best = {
        way: min((r for r in rows if r["way"] == way), key=lambda r: r["cpu us/placement"])
        for way in ("one by one", "together")
    }
    print_table(list(best.values()), f"{args.bursts} bursts of {args.size} placements")
    old, new = best["one by one"], best["together"]
    head = {
        "cpu_us_one_by_one": round(old["cpu us/placement"], 1),
        "cpu_us_together": round(new["cpu us/placement"], 1),
        "cpu_ratio": round(new["cpu us/placement"] / old["cpu us/placement"], 3),
        "wall_ms_burst_one_by_one": round(old["wall ms/burst"], 2),
        "wall_ms_burst_together": round(new["wall ms/burst"], 2),
        "batches_per_burst": round(new["batches/burst"], 1),
        "same_decisions": True,
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
