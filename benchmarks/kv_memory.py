"""KV memory utilisation: paged blocks vs contiguous reservations at equal memory.

Replays one seeded request mix — ShareGPT-like lognormal prompt and output lengths (means ~161
and ~338 tokens, as reported for ShareGPT in the vLLM paper), clients' ``max_tokens`` caps,
Poisson arrivals — through a step-level engine model (each step every running request decodes
one token; FCFS admission; a request finishes at its output length) against three allocators
of the same KV capacity:

* ``paged``: this project's :class:`KVCacheManager` (blocks on demand; preempt-by-recompute of
  the newest request when a decode finds no free block; 1% admission watermark);
* ``contig-maxlen``: a contiguous slab of ``max_model_len`` slots reserved per request;
* ``contig-reserve``: a contiguous slab of ``prompt + max_tokens`` slots (first-fit, so
  external fragmentation is real).

Reported per allocator (time-averaged over steps): the fraction of *allocated* KV slots that
hold live tokens, the fraction of the whole capacity holding live tokens (over all steps, and
over the steps where requests wait for memory), peak and mean
concurrent requests, steps to drain the mix, preemptions, and for the paged manager its CPU
cost per token processed (``time.perf_counter`` spent in its calls). A sweep over block
sizes 8..128 plots waste and that overhead.
Target: paged >= 97% at block size 16.

    .venv/bin/python -m benchmarks.kv_memory            # 2000 requests, ~1 min
    .venv/bin/python -m benchmarks.kv_memory --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from worker.kv import KVCacheManager

TARGET_PAGED_UTIL = 0.97
BLOCK_SIZES = [8, 16, 32, 64, 128]


@dataclass(slots=True)
class Req:
    rid: int
    arrival: int  # engine step at which it arrives
    prompt: int  # prompt tokens
    max_tokens: int  # the client's cap on output tokens
    output: int  # tokens it will actually generate (<= max_tokens)
    generated: int = 0  # output tokens so far (kept across preemption)
    length: int = 0  # tokens with KV in memory now (0 while waiting)
    offset: int = -1  # contiguous slab start, if any


def make_workload(n: int, rate: float, max_model_len: int, seed: int) -> list[Req]:
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(161) - 0.5, 1.0, n), 4, max_model_len // 2).astype(int)
    cap = rng.choice([256, 512, 1024, 2048], n)
    max_tokens = np.minimum(cap, max_model_len - prompt)
    output = np.clip(rng.lognormal(np.log(338) - 0.405, 0.9, n).astype(int), 1, max_tokens)
    arrival = np.floor(np.cumsum(rng.exponential(1.0 / rate, n))).astype(int)
    return [
        Req(i, int(arrival[i]), int(prompt[i]), int(max_tokens[i]), int(output[i]))
        for i in range(n)
    ]


class Paged:
    """Adapter: the paged manager (prefix caching off: this measures paging alone)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.kv = KVCacheManager(capacity // block_size, block_size, enable_prefix_caching=False)
        self.watermark = max(1, self.kv.num_blocks // 100)
        self.tokens = [0] * (capacity + 1)  # contents are irrelevant with caching off
        self.seconds = 0.0  # CPU time spent inside the manager

    def admit(self, r: Req) -> bool:
        t = time.perf_counter()
        need = -(-(r.prompt + r.generated) // self.kv.block_size)
        ok = self.kv.can_fit(need + self.watermark)
        if ok:
            self.kv.allocate_slots(r.rid, self.tokens, r.prompt + r.generated)
        self.seconds += time.perf_counter() - t
        return ok

    def grow(self, r: Req) -> bool:
        t = time.perf_counter()
        ok = self.kv.allocate_slots(r.rid, self.tokens, 1) is not None
        self.seconds += time.perf_counter() - t
        return ok

    def release(self, r: Req) -> None:
        t = time.perf_counter()
        self.kv.free(r.rid)
        self.seconds += time.perf_counter() - t

    def allocated(self) -> int:
        return self.kv.stats().used_blocks * self.kv.block_size


class Contiguous:
    """Adapter: one contiguous slab per request, first-fit over a sorted free-interval list."""

    def __init__(self, capacity: int, reserve) -> None:
        self.free_list = [(0, capacity)]  # (start, size), sorted, coalesced
        self.reserve = reserve  # Req -> slots to reserve
        self.used = 0

    def admit(self, r: Req) -> bool:
        size = self.reserve(r)
        for i, (start, free) in enumerate(self.free_list):
            if free >= size:
                self.free_list[i : i + 1] = [(start + size, free - size)] if free > size else []
                r.offset, self.used = start, self.used + size
                return True
        return False

    def grow(self, r: Req) -> bool:
        return True  # the reservation already covers every token the request may produce

    def release(self, r: Req) -> None:
        size = self.reserve(r)
        self.used -= size
        merged = sorted([*self.free_list, (r.offset, size)])
        self.free_list = []
        for start, free in merged:
            if self.free_list and sum(self.free_list[-1]) == start:
                self.free_list[-1] = (self.free_list[-1][0], self.free_list[-1][1] + free)
            else:
                self.free_list.append((start, free))

    def allocated(self) -> int:
        return self.used


def simulate(reqs: list[Req], alloc, capacity: int) -> dict:
    """Run the step loop until every request finished; return time-averaged figures."""
    reqs = [Req(r.rid, r.arrival, r.prompt, r.max_tokens, r.output) for r in reqs]
    waiting: deque[Req] = deque()
    running: list[Req] = []
    nxt = step = peak = preemptions = live = 0
    sum_live = sum_alloc = sum_running = tokens = busy_steps = busy_live = 0

    def preempt(victim: Req) -> None:
        nonlocal live, preemptions
        alloc.release(victim)
        live -= victim.length
        victim.length = 0
        waiting.appendleft(victim)
        preemptions += 1

    while nxt < len(reqs) or waiting or running:
        while nxt < len(reqs) and reqs[nxt].arrival <= step:
            waiting.append(reqs[nxt])
            nxt += 1
        survivors: list[Req] = []
        i = 0
        while i < len(running):  # decode, oldest first; preempt the newest on a miss
            r = running[i]
            ok = alloc.grow(r)
            while not ok and running[-1] is not r:
                preempt(running.pop())
                ok = alloc.grow(r)
            if not ok:
                preempt(running.pop())
                break
            r.length += 1
            r.generated += 1
            live += 1
            tokens += 1
            if r.generated >= r.output:
                alloc.release(r)
                live -= r.length
            else:
                survivors.append(r)
            i += 1
        running = survivors
        while waiting and alloc.admit(waiting[0]):  # FCFS admission (prefill)
            r = waiting.popleft()
            r.length = r.prompt + r.generated
            live += r.length
            tokens += r.length
            running.append(r)
        assert waiting or running or nxt < len(reqs) or not alloc.allocated()
        sum_live += live
        if waiting:  # saturated: requests wait for memory
            busy_steps += 1
            busy_live += live
        sum_alloc += alloc.allocated()
        sum_running += len(running)
        peak = max(peak, len(running))
        step += 1
    return {
        "util_allocated": sum_live / max(sum_alloc, 1),
        "util_capacity": sum_live / (capacity * step),
        "util_capacity_saturated": busy_live / (capacity * max(busy_steps, 1)),
        "peak_concurrent": peak,
        "mean_concurrent": sum_running / step,
        "steps": step,
        "preemptions": preemptions,
        "tokens": tokens,
    }


def run(args: argparse.Namespace) -> tuple[list[dict], dict]:
    reqs = make_workload(args.requests, args.rate, args.max_model_len, args.seed)
    cap, mml = args.capacity, args.max_model_len
    rows: list[dict] = []
    for name, alloc in [
        ("contig-maxlen", Contiguous(cap, lambda r: mml)),
        ("contig-reserve", Contiguous(cap, lambda r: r.prompt + r.max_tokens)),
    ]:
        rows.append({"allocator": name, "block": "-", **simulate(reqs, alloc, cap)})
    for bs in args.block_sizes:
        paged = Paged(cap, bs)
        res = simulate(reqs, paged, cap)
        res["us_per_token"] = 1e6 * paged.seconds / res["tokens"]
        rows.append({"allocator": "paged", "block": bs, **res})
    workload = {
        "mean_prompt": float(np.mean([r.prompt for r in reqs])),
        "mean_output": float(np.mean([r.output for r in reqs])),
        "mean_max_tokens": float(np.mean([r.max_tokens for r in reqs])),
    }
    return rows, workload


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    paged = [r for r in rows if r["allocator"] == "paged"]
    bs = [r["block"] for r in paged]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(bs, [100 * (1 - r["util_allocated"]) for r in paged], "o-", color="C0")
    ax.set(xscale="log", xlabel="block size (tokens)", ylabel="waste: allocated, not live (%)")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax2 = ax.twinx()
    ax2.plot(bs, [r["us_per_token"] for r in paged], "s--", color="C1")
    ax2.set_ylabel("manager time per token (µs)", color="C1")
    ax.set_title("Paged KV cache: waste and overhead vs block size")
    save_figure(fig, "kv_memory_block_size.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per engine step")
    parser.add_argument("--capacity", type=int, default=65536, help="KV slots (tokens)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=BLOCK_SIZES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.capacity, args.block_sizes = 150, 16384, [16, 64]
    rows, workload = run(args)
    print_table([{k: round(v, 1) for k, v in workload.items()}], "workload (tokens)")
    table = [
        {
            "allocator": r["allocator"],
            "block": r["block"],
            "live/allocated %": 100 * r["util_allocated"],
            "live/capacity %": 100 * r["util_capacity"],
            "…saturated %": 100 * r["util_capacity_saturated"],
            "peak reqs": r["peak_concurrent"],
            "mean reqs": r["mean_concurrent"],
            "steps": r["steps"],
            "preempt": r["preemptions"],
            "µs/token": r.get("us_per_token", "-"),
        }
        for r in rows
    ]
    print_table(table, f"KV memory utilisation at equal capacity ({args.capacity:,} slots)")
    plot(rows)
    by = {(r["allocator"], r["block"]): r for r in rows}
    p16 = by.get(("paged", 16)) or next(r for r in rows if r["allocator"] == "paged")
    head = {
        "kv_mem_paged16_util_pct": round(100 * p16["util_allocated"], 2),
        "kv_mem_paged16_vs_target": round(p16["util_allocated"] / TARGET_PAGED_UTIL, 4),
        "kv_mem_contig_maxlen_util_pct": round(100 * by["contig-maxlen", "-"]["util_allocated"], 2),
        "kv_mem_contig_reserve_util_pct": round(
            100 * by["contig-reserve", "-"]["util_allocated"], 2
        ),
        "kv_mem_paged16_capacity_saturated_pct": round(100 * p16["util_capacity_saturated"], 2),
        "kv_mem_contig_maxlen_capacity_saturated_pct": round(
            100 * by["contig-maxlen", "-"]["util_capacity_saturated"], 2
        ),
        "kv_mem_paged16_peak_reqs": p16["peak_concurrent"],
        "kv_mem_contig_maxlen_peak_reqs": by["contig-maxlen", "-"]["peak_concurrent"],
        "kv_mem_contig_reserve_peak_reqs": by["contig-reserve", "-"]["peak_concurrent"],
        "kv_mem_paged16_us_per_token": round(p16["us_per_token"], 3),
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
