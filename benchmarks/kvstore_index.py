"""Benchmark of the Redis KV block index (kvstore).

Populates ``--entries`` cached (block, worker) pairs over ``--workers`` simulated workers:
chains of ``--chain`` blocks, each chain held by ``--sharing`` workers (as a shared system
prompt or a popular document would be); with ``--record-every k`` the workers send every k-th
key, as their Recorder would. Measures

* recorded block events/s applied in batches of ``--batch`` keys (the populate phase), and of
  small batches of stored+removed keys (steady-state churn);
* lookup latency p50/p99, measured by the client end to end (key packing, one round trip,
  decoding), for prompts of 128, 2k and 8k blocks that all ``--sharing`` holders hold in full
  (the longest scan), and for a miss;
* Redis memory per (block, worker) entry from ``INFO memory`` before/after populating.

Targets (issue 5): lookup p99 <= 2 ms for 2k blocks on loopback; >= 200k block events/s.

    .venv/bin/python -m benchmarks.kvstore_index            # 1M entries, 64 workers
    .venv/bin/python -m benchmarks.kvstore_index --smoke    # a few seconds
    .venv/bin/python -m benchmarks.kvstore_index --url redis://host:6379/0
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from contextlib import ExitStack

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from kvstore import IndexConfig, KVIndex
from worker.kv.hashing import BlockKey

TARGET_LOOKUP_P99_MS = 2.0
TARGET_EVENTS_PER_S = 200_000


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _chains(n_chains: int, length: int, rng: random.Random) -> list[list[BlockKey]]:
    return [[BlockKey(rng.randbytes(16)) for _ in range(length)] for _ in range(n_chains)]


def populate(index: KVIndex, args: argparse.Namespace, rng: random.Random) -> dict:
    """Register workers and store chains in batches; returns the chains and the rate."""
    workers = [f"w{i:03d}" for i in range(args.workers)]
    epochs = {w: index.register(w) for w in workers}
    n_chains = max(1, args.entries // (args.chain * args.sharing))
    chains = _chains(n_chains, args.chain, rng)
    holders = {c: [workers[(c * args.sharing + j) % len(workers)] for j in range(args.sharing)]
               for c in range(n_chains)}  # fmt: skip
    seq = dict.fromkeys(workers, 0)
    entries = 0
    k = args.record_every
    t0 = time.perf_counter()
    for c, chain in enumerate(chains):
        recorded = chain[k - 1 :: k]  # what each holder's Recorder sends
        for w in holders[c]:
            for start in range(0, len(recorded), args.batch):
                seq[w] += 1
                ops = [("S", tuple(recorded[start : start + args.batch]))]
                result = index.apply_ops(w, epochs[w], seq[w], ops)
                assert result.applied, result
                entries += result.added
    elapsed = time.perf_counter() - t0
    return {"chains": chains, "holders": holders, "epochs": epochs, "seq": seq,
            "entries": entries, "events_per_s": entries / elapsed}  # fmt: skip


def churn(index: KVIndex, state: dict, args: argparse.Namespace, rng: random.Random) -> float:
    """Small batches (a step's worth) of stored then removed fresh keys; recorded events/s."""
    w = next(iter(state["epochs"]))
    epoch, seq = state["epochs"][w], state["seq"][w]
    n_batches = 50 if args.smoke else 400
    fresh = _chains(n_batches, args.small_batch, rng)
    t0 = time.perf_counter()
    for keys in fresh:
        seq += 1
        assert index.apply_ops(w, epoch, seq, [("S", tuple(keys))]).applied
    for keys in fresh:
        seq += 1
        assert index.apply_ops(w, epoch, seq, [("R", tuple(keys))]).applied
    state["seq"][w] = seq
    return 2 * n_batches * args.small_batch / (time.perf_counter() - t0)


class ServerTimer:
    """Per-call execution time inside Redis (SLOWLOG with a 0 us threshold), if allowed."""

    def __init__(self, index: KVIndex) -> None:
        self.client = index.client
        try:
            self.client.config_set("slowlog-log-slower-than", 0)
            self.client.config_set("slowlog-max-len", 100_000)
            self.enabled = True
        except Exception:  # noqa: BLE001 - managed Redis may forbid CONFIG
            self.enabled = False

    def reset(self) -> None:
        if self.enabled:
            self.client.slowlog_reset()

    def evalsha_us(self) -> list[float]:
        if not self.enabled:
            return []
        log = self.client.slowlog_get(100_000)
        return [e["duration"] for e in log if e["command"].split(b" ")[0].upper() == b"EVALSHA"]


def lookups(
    index: KVIndex, state: dict, n_blocks: int, reps: int, rng: random.Random, timer: ServerTimer
) -> dict:
    chains, holders = state["chains"], state["holders"]
    index.lookup(chains[0][:n_blocks])  # warm up (script cache, connection)
    timer.reset()
    lat: list[float] = []
    for _ in range(reps):
        c = rng.randrange(len(chains))
        prompt = chains[c][:n_blocks]
        t0 = time.perf_counter()
        got = index.lookup(prompt)
        lat.append((time.perf_counter() - t0) * 1e3)
        k = index.config.record_every
        expect = min(n_blocks, len(chains[c])) // k * k
        assert all(got[w] == expect for w in holders[c]), (got, holders[c], expect)
    server = [us / 1e3 for us in timer.evalsha_us()] or [float("nan")]
    return {"p50_ms": statistics.median(lat), "p99_ms": _percentile(lat, 0.99),
            "server_p50_ms": statistics.median(server),
            "server_p99_ms": _percentile(server, 0.99)}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    with ExitStack() as stack:
        url = args.url
        if url is None:
            from tests.redis_server import RedisServer

            url = stack.enter_context(RedisServer()).url
        model = f"bench-{os.getpid()}"
        cfg = IndexConfig(url=url, model_id=model, record_every=args.record_every,
                          socket_timeout_s=30.0, heartbeat_ttl_s=3600.0)  # workers stay live
        index = KVIndex(cfg)
        stack.callback(index.close)
        if args.url is not None:  # leave a shared server clean
            stack.callback(_delete_namespace, index)
        mem0 = index.memory_used()
        state = populate(index, args, rng)
        mem1 = index.memory_used()
        distinct = sum(len(c) for c in state["chains"])
        churn_rate = churn(index, state, args, rng)
        timer = ServerTimer(index)
        sizes = [s for s in (128, 2048, 8192) if s <= args.chain]
        lat = {n: lookups(index, state, n, args.reps, rng, timer) for n in sizes}
        ping = []
        for _ in range(max(args.reps, 1000)):  # the environment's own round-trip noise
            t0 = time.perf_counter()
            index.client.ping()
            ping.append((time.perf_counter() - t0) * 1e3)
        miss = [BlockKey(rng.randbytes(16)) for _ in range(2048)]
        t0 = time.perf_counter()
        for _ in range(args.reps):
            assert not any(index.lookup(miss).values())
        miss_ms = (time.perf_counter() - t0) * 1e3 / args.reps
    cached = state["entries"] * args.record_every  # (block, worker) pairs the workers hold
    return {"entries": state["entries"], "cached": cached, "distinct_blocks": distinct,
            "workers": args.workers, "events_per_s": state["events_per_s"],
            "churn_events_per_s": churn_rate,
            "bytes_per_entry": (mem1 - mem0) / state["entries"],
            "bytes_per_cached": (mem1 - mem0) / cached,
            "bytes_per_distinct_block": (mem1 - mem0) / distinct,
            "lookup": lat, "miss_2k_ms": miss_ms,
            "ping": {"p50_ms": statistics.median(ping),
                     "p99_ms": _percentile(ping, 0.99)}}  # fmt: skip


def _delete_namespace(index: KVIndex) -> None:
    pattern = index.config.namespace.replace("{", "\\{").replace("}", "\\}") + "*"
    for key in index.client.scan_iter(match=pattern, count=1000):
        index.client.unlink(key)


def report(res: dict, args: argparse.Namespace) -> dict:
    title = f"kvstore index{' (smoke)' if args.smoke else ''}"
    print_table([
        {"measure": "record_every", "value": args.record_every},
        {"measure": "(block, worker) pairs cached", "value": res["cached"]},
        {"measure": "(block, worker) entries recorded", "value": res["entries"]},
        {"measure": "distinct blocks", "value": res["distinct_blocks"]},
        {"measure": "workers", "value": res["workers"]},
        {"measure": f"apply events/s, batches of {args.batch}", "value": res["events_per_s"]},
        {"measure": f"apply events/s, batches of {args.small_batch} (S+R)",
         "value": res["churn_events_per_s"]},
        {"measure": "Redis bytes per recorded entry", "value": res["bytes_per_entry"]},
        {"measure": "Redis bytes per cached (block, worker)", "value": res["bytes_per_cached"]},
        {"measure": "Redis bytes per distinct block", "value": res["bytes_per_distinct_block"]},
        {"measure": "lookup 2048-block miss, mean ms", "value": res["miss_2k_ms"]},
        {"measure": "PING p50 ms (round-trip floor)", "value": res["ping"]["p50_ms"]},
        {"measure": "PING p99 ms (round-trip floor)", "value": res["ping"]["p99_ms"]},
    ], title)  # fmt: skip
    print_table([
        {"prompt blocks": n, "client p50 ms": v["p50_ms"], "client p99 ms": v["p99_ms"],
         "in-Redis p50 ms": v["server_p50_ms"], "in-Redis p99 ms": v["server_p99_ms"]}
        for n, v in res["lookup"].items()
    ], f"{title}: lookup latency, full hits ({args.sharing} holders each)")  # fmt: skip
    head = {
        "kvstore_record_every": args.record_every,
        "kvstore_entries": res["entries"],
        "kvstore_apply_events_per_s": round(res["events_per_s"]),
        "kvstore_churn_events_per_s": round(res["churn_events_per_s"]),
        "kvstore_bytes_per_entry": round(res["bytes_per_entry"], 1),
        "kvstore_bytes_per_cached_block_worker": round(res["bytes_per_cached"], 1),
        "kvstore_bytes_per_distinct_block": round(res["bytes_per_distinct_block"], 1),
    }
    for n, v in res["lookup"].items():
        for stat in ("p50_ms", "p99_ms", "server_p99_ms"):
            head[f"kvstore_lookup_{n}_{stat}"] = round(v[stat], 4)
    if 2048 in res["lookup"]:
        head["kvstore_lookup_2k_p99_vs_target"] = round(
            res["lookup"][2048]["p99_ms"] / TARGET_LOOKUP_P99_MS, 3
        )
    head["kvstore_ping_p99_ms"] = round(res["ping"]["p99_ms"], 4)
    head["kvstore_events_per_s_vs_target"] = round(res["events_per_s"] / TARGET_EVENTS_PER_S, 3)
    return head


def plot(res: dict) -> None:
    plt = pyplot()
    sizes = list(res["lookup"])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for key, label, mark in (("p50_ms", "client p50", "o-"), ("p99_ms", "client p99", "s-"),
                             ("server_p99_ms", "in-Redis p99", "^--")):  # fmt: skip
        ax.plot(sizes, [res["lookup"][n][key] for n in sizes], mark, label=label)
    ax.axhline(TARGET_LOOKUP_P99_MS, color="grey", ls=":", label="p99 target (2k blocks)")
    ax.set(xscale="log", xlabel="prompt length (blocks)", ylabel="lookup latency (ms)",
           title=f"KV index lookup, {res['entries']:,} entries")  # fmt: skip
    ax.legend()
    save_figure(fig, "kvstore_lookup.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--url", help="use this Redis instead of starting a local one")
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--sharing", type=int, default=4, help="workers holding each chain")
    parser.add_argument("--chain", type=int, default=8192, help="blocks per chain")
    parser.add_argument("--batch", type=int, default=2048, help="keys per populate batch")
    parser.add_argument("--small-batch", type=int, default=32, help="keys per churn batch")
    parser.add_argument("--reps", type=int, default=300, help="lookups per prompt size")
    parser.add_argument("--record-every", type=int, default=1, help="index granularity k")
    args = parser.parse_args(argv)
    if args.smoke:
        args.entries, args.workers, args.chain, args.reps = 20_000, 8, 2048, 30
    res = run(args)
    head = report(res, args)
    plot(res)
    emit_json(head)


if __name__ == "__main__":
    main()
