"""Cost of the Redis index's per-tier lookup (host KV tier) against the device-only lookup.

``--workers`` workers hold one ``--chain``-block prompt to the depths of a *layout*:

* ``full``: every worker holds the first half on its device and the rest in its host tier;
* ``staggered``: worker i holds a distinct device depth and a distinct deeper host depth
  (two breakpoints per worker: bisect's bad case).

Two namespaces of one Redis are populated: *tiered* (as above) and *device-only* (the same
union depths, all on the device: what an index without host tiers holds). Measured per lookup
mode (bisect, scan), client end to end and inside Redis (SLOWLOG), every answer checked:

* ``lookup`` on device-only: the device-only lookup's cost (the baseline of the ratios);
* ``lookup_tiers`` on device-only: what a router would pay when no worker has a host tier
  (one EXISTS more; the router asks ``lookup`` then, as no candidate's load reports one);
* ``lookup_tiers`` on tiered: the union walk reads both hashes per probe.

    .venv/bin/python -m benchmarks.kvstore_tier_lookup            # 16 workers, 2k blocks
    .venv/bin/python -m benchmarks.kvstore_tier_lookup --smoke    # a second or two

Measured (2 shared cores busy with other jobs, ``nice -n 10``, Redis on loopback; 16 workers,
2048 blocks, 500 lookups a case), in-Redis p50/p99 ms:

    layout     mode    lookup (dev-only)  lookup_tiers (dev-only)  lookup_tiers (tiered)
    full       bisect  0.085 / 0.135      0.085 / 0.135  (1.00x)   0.121 / 0.187  (1.42x)
    full       scan    0.694 / 0.831      0.699 / 0.811  (1.01x)   1.356 / 1.554  (1.95x)
    staggered  bisect  0.283 / 0.438      0.256 / 0.413  (0.90x)   0.592 / 0.717  (2.09x)
    staggered  scan    0.690 / 0.824      0.704 / 0.880  (1.02x)   1.414 / 2.259  (2.05x)

Without host entries the tier lookup costs what ``lookup`` does; with them at most about
twice (a second walk over both hashes), still one round trip.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from contextlib import ExitStack

from benchmarks.common import emit_json, print_table
from benchmarks.kvstore_index import ServerTimer, latency_summary
from kvstore.blocks.events import BlockStored
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from kvstore.config import IndexConfig
from kvstore.index import KVIndex

MODES = ("bisect", "scan")
LAYOUTS = ("full", "staggered")


def depths(layout: str, workers: int, n: int) -> list[tuple[int, int]]:
    """(device depth, union depth) of each worker."""
    if layout == "full":
        return [(n // 2, n)] * workers
    return [
        ((i + 1) * n // (2 * workers + 2), n - i * n // (2 * workers + 2)) for i in range(workers)
    ]


def populate(
    index: KVIndex, chain: list[BlockKey], layout: list[tuple[int, int]], tiered: bool
) -> None:
    for i, (d, u) in enumerate(layout):
        w = f"w{i}"
        epoch = index.register(w)
        if tiered:
            events = [BlockStored(0, tuple(chain[:d]), None, (), 16)]
            events.append(
                BlockStored(1, tuple(chain[d:u]), chain[d - 1] if d else None, (), 16, Tier.HOST)
            )
        else:
            events = [BlockStored(0, tuple(chain[:u]), None, (), 16)]
        assert index.apply_events(w, epoch, 1, events).applied


def _tiers(device: int, host: int) -> dict[Tier, int]:
    """A lookup_tiers answer of one worker: its leading blocks per tier holding any."""
    return {t: n for t, n in ((Tier.DEVICE, device), (Tier.HOST, host)) if n}


def measure(call: Callable[[], dict], expect: dict, reps: int, timer: ServerTimer) -> dict:
    assert call() == expect, (call(), expect)  # warm up and check
    timer.reset()
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = call()
        lat.append((time.perf_counter() - t0) * 1e3)
        assert got == expect
    return latency_summary(lat, timer)


def run(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(0)
    chain = [BlockKey(rng.randbytes(16)) for _ in range(args.chain)]
    rows = []
    with ExitStack() as stack:
        from cluster.local_redis import LocalRedis

        url = stack.enter_context(LocalRedis()).url
        for layout_name in LAYOUTS:
            layout = depths(layout_name, args.workers, args.chain)
            idx = {}
            for tiered in (False, True):
                model = f"tiers-{os.getpid()}-{layout_name}-{int(tiered)}"
                for mode in MODES:
                    cfg = IndexConfig(
                        url=url,
                        model_id=model,
                        lookup=mode,
                        socket_timeout_s=30.0,
                        heartbeat_ttl_s=3600.0,
                    )
                    idx[tiered, mode] = index = KVIndex(cfg)
                    stack.callback(index.close)
                populate(idx[tiered, "bisect"], chain, layout, tiered)
            timer = ServerTimer(idx[False, "bisect"])
            union = {f"w{i}": u for i, (_, u) in enumerate(layout)}
            split = {f"w{i}": _tiers(d, u - d) for i, (d, u) in enumerate(layout)}
            for mode in MODES:
                dev, tier = idx[False, mode], idx[True, mode]
                cases = {
                    "lookup, device-only index": (lambda i=dev: i.lookup(chain), union),
                    "lookup_tiers, device-only index": (
                        lambda i=dev: i.lookup_tiers(chain),
                        {w: _tiers(u, 0) for w, u in union.items()},
                    ),
                    "lookup_tiers, tiered index": (lambda i=tier: i.lookup_tiers(chain), split),
                }
                base = None
                for name, (call, expect) in cases.items():
                    m = measure(call, expect, args.reps, timer)
                    base = base or m
                    ratio = m["server_p50_ms"] / base["server_p50_ms"]
                    rows.append(
                        {
                            "layout": layout_name,
                            "mode": mode,
                            "call": name,
                            **m,
                            "server_p50_vs_lookup": ratio,
                        }
                    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a second or two")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--chain", type=int, default=2048, help="blocks of the prompt")
    parser.add_argument("--reps", type=int, default=500, help="lookups per case")
    args = parser.parse_args(argv)
    if args.smoke:
        args.workers, args.chain, args.reps = 4, 256, 20
    rows = run(args)
    print_table(
        [
            {
                "layout": r["layout"],
                "mode": r["mode"],
                "call": r["call"],
                "client p50/p99 ms": f"{r['p50_ms']:.3f} / {r['p99_ms']:.3f}",
                "in-Redis p50/p99 ms": f"{r['server_p50_ms']:.3f} / {r['server_p99_ms']:.3f}",
                "in-Redis p50 vs lookup": round(r["server_p50_vs_lookup"], 2),
            }
            for r in rows
        ],
        f"kvstore tier lookup: {args.workers} workers, {args.chain}-block prompt"
        f"{' (smoke)' if args.smoke else ''}",
    )
    head: dict[str, float | int] = {
        "tier_lookup_workers": args.workers,
        "tier_lookup_chain": args.chain,
    }
    for r in rows:
        name = r["call"].split(",")[0] + ("_tiered" if "tiered" in r["call"] else "_devonly")
        key = f"tier_lookup_{r['layout']}_{r['mode']}_{name}"
        head[f"{key}_server_p50_ms"] = round(r["server_p50_ms"], 4)
        head[f"{key}_server_p50_vs_lookup"] = round(r["server_p50_vs_lookup"], 3)
    emit_json(head)


if __name__ == "__main__":
    main()
