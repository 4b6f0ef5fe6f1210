"""Disk KV tier on the real CPU engine: a working set about 4 x (device + host), a restart,
and the read-vs-recompute crossover.

1. **Working set.** Zipf-distributed documents (``--docs`` of ``--doc-len`` tokens, each asked
   with a short distinct question) mixed with multi-turn sessions (each turn's prompt is the
   session so far plus a new message), together about ``--working-x`` times the device and
   host caches. Served in waves of ``--max-seqs`` requests by an engine with the host tier
   only and one with host + disk: throughput, mean TTFT, prompt tokens by the tier they came
   from. Greedy outputs must be identical. Targets: >= 1.5x throughput, <= 0.5x mean TTFT.
2. **Restart.** After the warm-up trace the disk directory is copied; the engine that kept
   running answers a probe trace (its hit rate: pre-restart), an engine restarted on the
   copy answers the same probe (disk-warm), and one on an empty directory too (cold). Target:
   disk-warm >= 90 % of the pre-restart hit rate.
3. **Crossover.** Blocks read per second from the disk tier (timed reads of runs) against
   blocks recomputed per second (the engine's measured prefill rate): a disk hit pays while
   the first is larger; the tier prices each hit with both (``recompute_seconds``).

The machine may be shared: treat the figures of one run as indicative.

    .venv/bin/python -m benchmarks.disk_tier            # ~32M-parameter model, minutes
    .venv/bin/python -m benchmarks.disk_tier --smoke    # tiny model, seconds
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from kvstore.blocks.tiers import Tier
from kvstore.requests.sampling_params import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.kv.disk_tier import DiskTier
from worker.model.build_tiny import build_tiny_model

TARGET_SPEEDUP = 1.5
TARGET_TTFT_RATIO = 0.5
TARGET_RESTART = 0.9


def _trace(args: argparse.Namespace, vocab: int, n: int, seed: int) -> list[list[int]]:
    """``n`` requests: Zipf documents and multi-turn sessions, interleaved."""
    rng = random.Random(args.seed)  # the documents and sessions are the same in every trace
    docs = [[rng.randrange(5, vocab) for _ in range(args.doc_len)] for _ in range(args.docs)]
    sessions = [
        [rng.randrange(5, vocab) for _ in range(args.doc_len)] for _ in range(args.sessions)
    ]
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.docs)]
    pick = random.Random(seed)
    turn = [0] * args.sessions
    out = []
    for _ in range(n):
        if pick.random() < args.session_share:
            s = pick.randrange(args.sessions)
            turn[s] = turn[s] % args.turns + 1  # a session that ran its turns starts again
            msg = random.Random(s * 1000 + turn[s])
            grown = [msg.randrange(5, vocab) for _ in range(args.turn_len * turn[s])]
            out.append(sessions[s] + grown)
        else:
            d = pick.choices(range(args.docs), weights)[0]
            out.append(docs[d] + [pick.randrange(5, vocab) for _ in range(8)])
    return out


def _engine(model_dir: Path, args: argparse.Namespace, disk: Path | None) -> Engine:
    cfg = EngineConfig(
        num_blocks=args.device_blocks,
        max_num_seqs=args.max_seqs,
        max_num_batched_tokens=args.batch_tokens,
        host_kv_bytes=args.host_blocks * args.block_bytes,
        disk_kv_bytes=args.disk_bytes if disk is not None else 0,
        disk_kv_path=str(disk) if disk is not None else "",
    )
    return Engine.from_model_dir(model_dir, cfg, model_id="bench")


def _serve(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Serve ``prompts`` in waves; the figures of this call only."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    before = engine.metrics()
    ttft_n, ttft_sum = before.ttft.count, before.ttft.mean * before.ttft.count
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), args.max_seqs):
        wave = engine.generate(prompts[i : i + args.max_seqs], params)
        outputs += [r.completions[0].token_ids for r in wave]
    wall = time.perf_counter() - start
    after = engine.metrics()
    by_before, by_after = before.cached_tokens_by_tier(), after.cached_tokens_by_tier()
    prompt_tokens = sum(len(p) for p in prompts)
    n = after.ttft.count - ttft_n
    tokens = prompt_tokens + sum(len(o) for o in outputs)
    row = {
        "wall_s": wall,
        "tok/s": tokens / wall,
        "ttft_mean_s": (after.ttft.mean * after.ttft.count - ttft_sum) / max(n, 1),
        "hit_rate": (after.prefix_hit_tokens - before.prefix_hit_tokens) / prompt_tokens,
    }
    for tier in ("device", "host", "disk"):
        got = by_after.get(tier, 0) - by_before.get(tier, 0)
        row[f"hit_{tier}"] = got / prompt_tokens
    row["outputs"] = outputs
    return row


def _disk(engine: Engine) -> DiskTier:
    tier = engine.kv.tiers.get(Tier.DISK)
    assert isinstance(tier, DiskTier)
    return tier


def _read_rate(engine: Engine, blocks: int) -> float:
    """Blocks per second read back (and checked) from the engine's disk tier."""
    store = _disk(engine).disk
    runs = store.held_runs()
    keys = [(k, t) for r in runs for k, t in zip(r.keys, r.token_ids, strict=True)][:blocks]
    if not keys:
        return 0.0
    start, n = time.perf_counter(), 0
    for i in range(0, len(keys), 16):
        part = keys[i : i + 16]
        if store.read([k for k, _ in part], [t for _, t in part]) is not None:
            n += len(part)
    return n / max(time.perf_counter() - start, 1e-9)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload (seconds)")
    ap.add_argument("--size", default="32m", help="build_tiny_model size (tiny, 32m, 100m)")
    ap.add_argument("--device-blocks", type=int, default=64, help="device KV blocks (16 tokens)")
    ap.add_argument("--host-blocks", type=int, default=64, help="host tier blocks")
    ap.add_argument("--docs", type=int, default=20, help="documents (Zipf popularity)")
    ap.add_argument("--doc-len", type=int, default=256, help="tokens per document / session start")
    ap.add_argument("--zipf", type=float, default=0.8, help="Zipf exponent of the documents")
    ap.add_argument("--sessions", type=int, default=8, help="multi-turn sessions")
    ap.add_argument("--turns", type=int, default=4, help="turns per session before it restarts")
    ap.add_argument("--turn-len", type=int, default=48, help="tokens each turn adds")
    ap.add_argument("--session-share", type=float, default=0.4, help="share of session turns")
    ap.add_argument("--requests", type=int, default=160, help="requests of the main trace")
    ap.add_argument("--probe", type=int, default=16, help="requests after the restart")
    ap.add_argument("--max-tokens", type=int, default=2, help="short answers: prefill-bound")
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (same for all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.device_blocks, args.host_blocks = "tiny", 16, 8
        args.docs, args.doc_len, args.sessions, args.turn_len = 16, 64, 4, 16
        args.requests, args.probe = 64, 8
    torch.set_num_threads(args.threads)
    model_dir = build_tiny_model(None, "llama", args.size, args.seed)
    probe = Engine.from_model_dir(model_dir, EngineConfig(num_blocks=args.device_blocks))
    vocab, bs = probe.executor.vocab_size, probe.config.block_size
    args.block_bytes = probe.executor.runner.bytes_per_block
    del probe
    unique = args.docs * args.doc_len + args.sessions * (args.doc_len + args.turns * args.turn_len)
    working_x = unique / bs / (args.device_blocks + args.host_blocks)
    args.disk_bytes = int(4 * unique / bs * args.block_bytes) + (1 << 20)
    trace = _trace(args, vocab, args.requests, seed=1)
    probe_trace = _trace(args, vocab, args.probe, seed=2)
    root = Path(tempfile.mkdtemp(prefix="disk-tier-bench-"))
    try:
        _serve(_engine(model_dir, args, None), trace[: args.max_seqs], args)  # warm-up
        host_only = _serve(_engine(model_dir, args, None), trace, args)
        engine = _engine(model_dir, args, root / "disk")
        with_disk = _serve(engine, trace, args)
        identical = host_only.pop("outputs") == with_disk.pop("outputs")
        host_only["disk_tier"], with_disk["disk_tier"] = "off", "on"
        # ---- restart ----
        assert _disk(engine).disk.drain(60)
        shutil.copytree(root / "disk", root / "restart")
        pre = _serve(engine, probe_trace, args)
        read_bps = _read_rate(engine, 256)
        rate = engine.prefill_rate.tokens_per_s or 0.0
        warm = _serve(_engine(model_dir, args, root / "restart"), probe_trace, args)
        cold = _serve(_engine(model_dir, args, root / "cold"), probe_trace, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    restart_rows = []
    for name, row in (
        ("pre-restart", pre),
        ("restarted, disk-warm", warm),
        ("restarted, cold", cold),
    ):
        row.pop("outputs")
        restart_rows.append({"engine": name, **row})
    speedup = with_disk["tok/s"] / host_only["tok/s"]
    ttft_ratio = with_disk["ttft_mean_s"] / max(host_only["ttft_mean_s"], 1e-9)
    regained = warm["hit_rate"] / pre["hit_rate"] if pre["hit_rate"] else 0.0
    recompute_bps = rate / bs
    cols = [
        "disk_tier",
        "wall_s",
        "tok/s",
        "ttft_mean_s",
        "hit_rate",
        "hit_device",
        "hit_host",
        "hit_disk",
    ]
    print_table(
        [{c: r[c] for c in cols} for r in (host_only, with_disk)],
        f"(1) working set {working_x:.1f}x (device + host), {args.size} model",
    )
    print_table(restart_rows, f"(2) restart: the first {args.probe} requests")
    print_table(
        [
            {
                "disk_read_blocks/s": read_bps,
                "recompute_blocks/s": recompute_bps,
                "read_pays": read_bps > recompute_bps,
            }
        ],
        "(3) read vs recompute",
    )
    print(
        f"\nThroughput {speedup:.2f}x (target >= {TARGET_SPEEDUP}), mean TTFT {ttft_ratio:.2f}x "
        f"(target <= {TARGET_TTFT_RATIO}); restart regains {regained:.0%} of the pre-restart "
        f"hit rate (target >= {TARGET_RESTART:.0%}); outputs identical: {identical}"
    )
    _plot(host_only, with_disk, restart_rows)
    headline = {
        "benchmark": "disk_tier",
        "smoke": args.smoke,
        "model": args.size,
        "working_set_x": round(working_x, 2),
        "throughput_speedup": round(speedup, 3),
        "ttft_mean_ratio": round(ttft_ratio, 3),
        "hit_rate_host_only": round(host_only["hit_rate"], 4),
        "hit_rate_disk": round(with_disk["hit_rate"], 4),
        "hit_disk_share": round(with_disk["hit_disk"], 4),
        "restart_hit_pre": round(pre["hit_rate"], 4),
        "restart_hit_warm": round(warm["hit_rate"], 4),
        "restart_hit_cold": round(cold["hit_rate"], 4),
        "restart_regained": round(regained, 3),
        "read_blocks_per_s": round(read_bps, 1),
        "recompute_blocks_per_s": round(recompute_bps, 1),
        "outputs_identical": identical,
        "target_met": identical
        and speedup >= TARGET_SPEEDUP
        and ttft_ratio <= TARGET_TTFT_RATIO
        and regained >= TARGET_RESTART,
    }
    emit_json(headline)
    if not identical:
        raise SystemExit("outputs differ with the disk tier on")
    return headline


def _plot(host_only: dict, with_disk: dict, restart_rows: list[dict]) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    tiers = ["hit_device", "hit_host", "hit_disk"]
    x = np.arange(2)
    bottom = np.zeros(2)
    for tier in tiers:
        vals = np.array([host_only[tier], with_disk[tier]])
        a.bar(x, vals, bottom=bottom, label=tier[4:])
        bottom += vals
    a.set_xticks(
        x,
        [
            f"host only\n{host_only['tok/s']:.0f} tok/s",
            f"host + disk\n{with_disk['tok/s']:.0f} tok/s",
        ],
    )
    a.set_ylabel("prompt tokens cached, by source tier")
    a.legend()
    a.set_title("working set ~4x (device + host)")
    b.bar([r["engine"] for r in restart_rows], [r["hit_rate"] for r in restart_rows])
    b.set_ylabel("hit rate of the first requests")
    b.set_title("restart")
    b.tick_params(axis="x", labelsize=7)
    save_figure(fig, "disk_tier.png")


if __name__ == "__main__":
    main()
