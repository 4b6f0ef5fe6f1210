"""Fleet-aware eviction in isolation: how much of a hot set a fleet of KV caches keeps when
every request lands on a random worker (least_loaded's view of the caches), per eviction
order, with the index's answer applied at once (no staleness).

``--workers`` real KV managers of ``--blocks`` blocks each serve one seeded stream: ``--groups``
system prompts of ``--prefix-tokens`` tokens plus a question of its own each; ``--concurrency``
requests are in flight at a time (their blocks pinned), the oldest finishes when a new one
starts. Eviction orders: ``lru`` (every block alike), ``keeper`` (what the workers do: a
block a lower-slot worker also holds is a spare, evicted first, ``EvictionOrder.set_spares``),
``any`` (a block any other worker holds is a spare; two holders may then both drop it at
once, which the keeper rule prevents). Reports the fleet's coverage of the hot set (its
blocks held somewhere, sampled after every request past the first 50) and the local hit rate.
A pull can only hit what the fleet covers, so coverage bounds ``least_loaded + pull``.

    .venv/bin/python -m benchmarks.fleet_eviction               # 152 and 256 blocks, seconds
    .venv/bin/python -m benchmarks.fleet_eviction --smoke       # seconds
"""

from __future__ import annotations

import argparse
import random

from benchmarks.common import emit_json, print_table
from worker.kv import HashContext, KVCacheManager, block_keys

ORDERS = ("lru", "keeper", "any")
BS = 16


def _spares(held: list[set], order: str) -> list[set]:
    if order == "lru":
        return [set() for _ in held]
    out = []
    for i, mine in enumerate(held):
        others = held[:i] + (held[i + 1 :] if order == "any" else [])
        out.append(mine & set().union(*others))
    return out


def run(order: str, blocks: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    ctx = HashContext()
    systems = [
        [rng.randrange(3, 30_000) for _ in range(args.prefix_tokens)] for _ in range(args.groups)
    ]
    hot = set().union(*(block_keys(p, BS, ctx) for p in systems))
    kvs = [KVCacheManager(blocks, BS) for _ in range(args.workers)]
    flight: list[tuple[int, int]] = []
    coverage, hit, total = [], 0, 0
    for rid in range(args.requests):
        w = rng.randrange(args.workers)
        prompt = systems[rng.randrange(args.groups)] + [rng.randrange(3, 30_000) for _ in range(40)]
        kv = kvs[w]
        while True:
            found = kv.lookup_prefix(prompt, ctx)
            new = len(prompt) - found.num_tokens
            if kv.allocate_slots(rid, prompt, new, ctx=ctx, prefix=found) is not None:
                break
            mine = [i for i, (ww, _) in enumerate(flight) if ww == w]
            assert mine, "a prompt larger than a worker's cache"
            kv.free(flight.pop(mine[0])[1])  # its oldest request finishes first
        hit, total = hit + found.num_tokens, total + len(prompt)
        flight.append((w, rid))
        while len(flight) > args.concurrency:
            ww, done = flight.pop(0)
            kvs[ww].free(done)
        held = [set(k.cached_keys()) for k in kvs]
        for k, spare in zip(kvs, _spares(held, order), strict=True):
            k.set_spares(spare)
        if rid >= 50:
            coverage.append(len(hot & set().union(*held)) / len(hot))
    return {
        "blocks": blocks,
        "hot_set_x": round(len(hot) / blocks, 2),
        "order": order,
        "coverage": round(sum(coverage) / len(coverage), 3),
        "hit_rate": round(hit / total, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", default="152,256", help="KV blocks per worker, a list")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=1020)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.blocks, args.requests, args.prefix_tokens = "40", 80, 240
    sizes = [int(x) for x in str(args.blocks).split(",")]
    rows = [run(order, b, args) for b in sizes for order in ORDERS]
    print_table(rows, f"fleet coverage, {args.workers} workers, random placement")
    by = {(r["blocks"], r["order"]): r for r in rows}
    head: dict = {"benchmark": "fleet_eviction", "smoke": args.smoke}
    for b in sizes:
        for order in ORDERS:
            head[f"coverage_{order}_{b}"] = by[(b, order)]["coverage"]
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
