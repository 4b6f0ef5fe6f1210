"""KV manager throughput: prefix lookup + allocate + free of whole prompts, 50% prefix hits.

Each op admits one prompt the way the scheduler does — ``lookup_prefix``, ``allocate_slots``
of the uncached rest (adopting the hit), then ``free`` and ``drain_events`` — in a pool large
enough to keep the shared prefixes cached while the unique halves are evicted again (so the
cost of lazy eviction and of the events is included). Half of every prompt is one of a few
shared prefixes, half is unique. Reported: ops/s and µs per block for 2k-token prompts, the
part of that spent in the chained hash alone, the cost of one decode step, and how the cost
grows with prompt length (it must be linear in blocks: µs per block stays flat). Times are
the process's CPU time (``time.process_time``): the manager is single-threaded pure Python, and
CPU time is not inflated by other load on a shared machine.

    .venv/bin/python -m benchmarks.kv_throughput            # ~30 s
    .venv/bin/python -m benchmarks.kv_throughput --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from kvstore.blocks.hashing import HashContext, block_keys
from worker.kv import KVCacheManager

CTX = HashContext("bench-model", None, "tenant-0")
LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384]
VOCAB = 32_000


def bench_prompts(length: int, ops: int, block_size: int, n_prefixes: int, seed: int) -> dict:
    """Time ``ops`` admissions of ``length``-token prompts with a 50% shared prefix."""
    rng = np.random.default_rng(seed)
    half = length // 2
    prefixes = [rng.integers(0, VOCAB, half).tolist() for _ in range(n_prefixes)]
    blocks_per_prompt = length // block_size
    kv = KVCacheManager(max(4096, 4 * blocks_per_prompt), block_size)
    for i, prefix in enumerate(prefixes):  # warm-up: the shared prefixes become cached
        kv.allocate_slots(("warm", i), prefix + [0], half + 1, ctx=CTX)
        kv.free(("warm", i))
    before = kv.stats()
    manager_s = hash_s = 0.0
    for op in range(ops):
        prompt = prefixes[op % n_prefixes] + rng.integers(0, VOCAB, length - half).tolist()
        t0 = time.process_time()
        hit = kv.lookup_prefix(prompt, CTX)
        alloc = kv.allocate_slots(op, prompt, length - hit.num_tokens, ctx=CTX, prefix=hit)
        kv.free(op)
        kv.drain_events()
        t1 = time.process_time()
        block_keys(prompt, block_size, CTX)  # the hashing alone, for comparison
        hash_s += time.process_time() - t1
        manager_s += t1 - t0
        assert alloc is not None
    after = kv.stats()
    kv.check_invariants()
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    queried = after.prefix_queried_tokens - before.prefix_queried_tokens
    return {
        "tokens": length,
        "blocks": blocks_per_prompt,
        "ops": ops,
        "ops/s": ops / manager_s,
        "µs/op": 1e6 * manager_s / ops,
        "µs/block": 1e6 * manager_s / (ops * blocks_per_prompt),
        "hash µs/block": 1e6 * hash_s / (ops * blocks_per_prompt),
        "hit rate": hits / queried,
    }


def bench_decode(steps: int, block_size: int) -> float:
    """µs per one-token ``allocate_slots`` of a running sequence (the per-step decode cost)."""
    kv = KVCacheManager(steps // block_size + 8, block_size)
    tokens = list(range(100, 100 + steps + 16))
    kv.allocate_slots("d", tokens, 16, ctx=CTX)
    t0 = time.process_time()
    for _ in range(steps):
        kv.allocate_slots("d", tokens, 1)
    return 1e6 * (time.process_time() - t0) / steps


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    blocks = [r["blocks"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(blocks, [r["µs/op"] for r in rows], "o-", label="lookup+allocate+free")
    ax.plot(blocks, [r["hash µs/block"] * r["blocks"] for r in rows], "s--", label="hashing alone")
    ax.set(xscale="log", yscale="log", xlabel="prompt length (blocks)", ylabel="µs per prompt")
    ax.set_title("KV manager cost vs prompt length (50% prefix hits)")
    ax.legend()
    save_figure(fig, "kv_throughput_scaling.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--ops", type=int, default=2000, help="admissions of 2k-token prompts")
    parser.add_argument("--sweep-tokens", type=int, default=2_000_000, help="tokens per length")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.ops, args.sweep_tokens, args.lengths = 100, 100_000, [256, 1024, 4096]
    bs = args.block_size
    main_row = bench_prompts(2048, args.ops, bs, args.prefixes, args.seed)
    print_table([main_row], f"2k-token prompts, 50% prefix hits, block size {bs}")
    rows = [
        bench_prompts(n, max(10, args.sweep_tokens // n), bs, args.prefixes, args.seed)
        for n in args.lengths
    ]
    print_table(rows, "cost vs prompt length (linear in blocks <=> flat µs/block)")
    # Least-squares fit of µs/op against blocks: linear cost gives R^2 ~ 1 and a flat ratio.
    x = np.array([r["blocks"] for r in rows], float)
    y = np.array([r["µs/op"] for r in rows])
    slope, intercept = np.polyfit(x, y, 1)
    r2 = 1 - np.sum((y - (slope * x + intercept)) ** 2) / np.sum((y - y.mean()) ** 2)
    ratio = rows[-1]["µs/block"] / rows[0]["µs/block"]
    decode_us = bench_decode(2000 if args.smoke else 50_000, bs)
    print_table(
        [
            {
                "fit µs/block": slope,
                "fit µs fixed": intercept,
                "R^2": r2,
                "µs/block ratio": ratio,
                "decode µs/step": decode_us,
            }
        ],
        f"linearity ({rows[0]['tokens']}..{rows[-1]['tokens']} tokens) and decode",
    )
    plot(rows)
    head = {
        "kv_tp_2k_ops_per_s": round(main_row["ops/s"], 1),
        "kv_tp_2k_us_per_block": round(main_row["µs/block"], 3),
        "kv_tp_2k_hash_us_per_block": round(main_row["hash µs/block"], 3),
        "kv_tp_2k_hit_rate": round(main_row["hit rate"], 4),
        "kv_tp_fit_us_per_block": round(float(slope), 3),
        "kv_tp_linear_r2": round(float(r2), 5),
        "kv_tp_us_per_block_ratio_long_vs_short": round(ratio, 3),
        "kv_tp_decode_us_per_step": round(decode_us, 3),
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
