"""Warm start: how fast a worker added to a warm fleet reaches the fleet's hit rate, with and
without pulling the fleet's hottest prefixes first.

A warm engine has served a stream of requests over ``--prefixes`` shared prefixes (Zipf
popularity, a short distinct tail each). A new engine then serves the next ``--requests``
of the same stream, once cold and once after importing the warm engine's ``--hot`` most
served prefixes (export and checked import, as ``PeerPulls.warm_start`` does between
actors). The fleet's hit rate is the warm engine's on that same stream; "reached" is the
first request after which the new engine's hit rate over the last ``--window`` requests is
at least the fleet's. Target: at least 3x sooner with the pulls. Real engines (tiny model,
CPU), so hit rates are exact; reaching is counted in requests served.

    .venv/bin/python -m benchmarks.kv_pull_warm            # seconds to a minute
    .venv/bin/python -m benchmarks.kv_pull_warm --smoke
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.engine.kv_pull import export_run, import_run
from worker.kv import block_keys
from worker.model.build_tiny import build_tiny_model

TARGET_SPEEDUP = 3.0
PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _stream(args: argparse.Namespace, vocab: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(5, vocab) for _ in range(args.prefix)] for _ in range(args.prefixes)]
    weights = [1.0 / (i + 1) for i in range(args.prefixes)]
    n = args.warm_requests + args.requests
    picks = rng.choices(range(args.prefixes), weights, k=n)
    return [(i, prefixes[i] + [rng.randrange(5, vocab) for _ in range(8)]) for i in picks]


def _engine(model_dir, args: argparse.Namespace) -> Engine:  # noqa: ANN001
    cfg = EngineConfig(num_blocks=args.blocks, max_model_len=args.prefix + 64)
    return Engine.from_model_dir(model_dir, cfg, model_id="bench")


def _hits(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Per request, the share of its prompt served from the cache."""
    out = []
    for p in prompts:
        res = engine.generate([p], PARAMS)[0]
        out.append(res.usage.cached_tokens / len(p))
    return out


def _reached(hits: list[float], fleet: float, window: int) -> int:
    """Requests served until the hit rate over the last ``window`` is >= ``fleet``."""
    for i in range(window, len(hits) + 1):
        if sum(hits[i - window : i]) / window >= fleet - 1e-9:
            return i
    return len(hits) + 1  # never, within the run


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", type=int, default=24)
    ap.add_argument("--prefix", type=int, default=256, help="tokens per shared prefix")
    ap.add_argument("--warm-requests", type=int, default=200)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--hot", type=int, default=12, help="hottest prefixes pulled")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=512, help="KV blocks per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prefixes, args.prefix, args.warm_requests, args.requests = 8, 64, 40, 40
        args.hot, args.window = 4, 5
    model_dir = build_tiny_model(None, "llama", "tiny")
    warm = _engine(model_dir, args)
    stream = _stream(args, warm.executor.vocab_size)
    served: Counter[int] = Counter()
    for i, _ in stream[: args.warm_requests]:
        served[i] += 1
    _hits(warm, [p for _, p in stream[: args.warm_requests]])
    later = [p for _, p in stream[args.warm_requests :]]
    fleet_hits = _hits(warm, later)
    fleet = sum(fleet_hits) / len(fleet_hits)
    cold = _engine(model_dir, args)
    cold_hits = _hits(cold, later)
    new = _engine(model_dir, args)
    ctx = new.hash_context(PARAMS)
    first = {i: p for i, p in reversed(stream[: args.warm_requests])}
    pulled = 0
    for i, _n in served.most_common(args.hot):
        p = first[i]
        run = export_run(warm, block_keys(p, 16, ctx)[: args.prefix // 16], ctx)
        if run is not None:
            prompt = [t for block in run.header.token_ids for t in block] + [0]
            pulled += import_run(new, run, prompt, ctx).blocks
    warm_hits = _hits(new, later)
    r_cold = _reached(cold_hits, fleet, args.window)
    r_warm = _reached(warm_hits, fleet, args.window)
    rows = [
        {"engine": "fleet (warm)", "hit_rate": fleet, "reached_after": 0},
        {"engine": "new, cold", "hit_rate": sum(cold_hits) / len(later), "reached_after": r_cold},
        {
            "engine": "new, warm start",
            "hit_rate": sum(warm_hits) / len(later),
            "reached_after": r_warm,
        },
    ]
    print_table(rows, f"warm start: {args.hot} hottest of {args.prefixes} prefixes pulled")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, hits in (("cold", cold_hits), ("warm start", warm_hits)):
        w = args.window
        ax.plot(
            [sum(hits[max(0, i - w) : i]) / min(i, w) for i in range(1, len(hits) + 1)], label=name
        )
    ax.axhline(fleet, color="gray", ls=":", label="fleet")
    ax.set_xlabel("requests served by the new worker")
    ax.set_ylabel(f"hit rate, last {args.window}")
    ax.legend()
    save_figure(fig, "kv_pull_warm.png")
    speedup = r_cold / max(r_warm, 1)
    head = {
        "benchmark": "kv_pull_warm",
        "smoke": args.smoke,
        "fleet_hit_rate": round(fleet, 4),
        "reached_cold_requests": r_cold,
        "reached_warm_requests": r_warm,
        "warm_speedup": round(speedup, 2),
        "pulled_blocks": pulled,
        "target_met": speedup >= TARGET_SPEEDUP,
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
