"""Draft-free speculative decoding (n-gram, suffix) against none, offline engine.

    python -m benchmarks.spec_decode                  # default model, the whole grid
    python -m benchmarks.spec_decode --cells edit:1,edit:4,chat:64   # some cells
    python -m benchmarks.spec_decode --smoke          # tiny model, a few seconds

Workloads (``benchmarks/spec_workloads.py``; greedy, ``ignore_eos``): ``edit`` (rewrite a
given function with one change: the answer repeats the prompt), ``json`` (a tool call whose
arguments echo a record in the prompt), ``agentic`` (three turns, each quoting the previous
answer again with a change; the prompt carries the earlier turns) and ``chat`` (plain
questions, little to copy), each rendered with the model's chat template. A cell: ``conc``
sessions at once (each turn of all sessions submitted together), ``--new`` tokens per turn
(``--new-at-load`` at 16 sessions or more: the grid then fits in about 15 minutes on 2
cores). Per cell and method: output tokens/s (wall, prefill included), the speed-up over
``none`` (and per CPU-second of the process: ``cpu speedup``, steadier than the wall clock
on a machine shared with other jobs), mean inter-token latency (the engine's) and its ratio
to ``none``'s, mean acceptance length (tokens per verify: 1 + accepted drafts / sequences
verified), and whether the greedy tokens equal ``none``'s. Each method runs on a fresh
engine, one after another, in one process; a cell runs ``--repeat`` times (default 3), the
methods' order reversed every other time (none, suffix, suffix, none: a drift of the machine
weighs on both alike), its figures pooled over the repeats (tokens over seconds). Before the
first cell the largest cell runs once, unmeasured, with every method: the process's first
steps at each batch size pay one-off costs (oneDNN builds its kernels per row count) that
would otherwise fall on whichever method ran first. Table, ``spec_decode.png`` (speed-up per
cell) and a final JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

from benchmarks.spec_workloads import WORKLOADS, play_turn, turns


def engine_of(model: str, method: str, conc: int):  # noqa: ANN201 - an Engine
    importlib.import_module("worker")
    from worker.engine import Engine, EngineConfig

    cfg = EngineConfig(
        max_num_seqs=max(conc, 1),
        max_num_batched_tokens=max(2048, conc * 8),
        kv_memory_bytes=1 << 29,
        enable_prefix_caching=True,
        speculative={"method": method},
    )
    engine = Engine.from_model_dir(model, cfg)
    warm(engine)
    return engine


def warm(engine: object) -> None:
    from kvstore.requests.sampling_params import SamplingParams

    engine.generate(["warm up"], SamplingParams(temperature=0, max_tokens=2))  # type: ignore[attr-defined]


def spec_figures(engine: object) -> tuple[int, int]:
    """(sequences that verified drafts, accepted draft tokens) since the engine started."""
    snap = engine.snapshot()  # type: ignore[attr-defined]
    return snap.spec_decode_num_drafts, snap.spec_decode_num_accepted_tokens


def accept_len(drafts: int, accepted: int) -> float:
    """Tokens a sequence gained per verify step (1: nothing verified)."""
    return 1 + accepted / drafts if drafts else 1.0


def run_cell(model: str, method: str, workload: str, conc: int, new: int) -> dict:
    """``conc`` sessions of ``workload`` at once, each turn of all sessions together, on a
    fresh engine speculating with ``method``."""
    from kvstore.requests.sampling_params import SamplingParams

    engine = engine_of(model, method, conc)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    sessions = [turns(workload, i) for i in range(conc)]
    histories: list[list[dict]] = [[] for _ in range(conc)]
    tokens: list[list[int]] = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    for turn in range(max(map(len, sessions))):
        live = [i for i, s in enumerate(sessions) if turn < len(s)]
        texts = [sessions[i][turn] for i in live]
        for c in play_turn(engine, [histories[i] for i in live], texts, params):
            tokens.append(list(c.token_ids))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    drafts, accepted = spec_figures(engine)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "itl_s": engine.metrics().itl.mean,
        "drafts": drafts,
        "accepted": accepted,
        "tokens": tokens,
    }


def run_repeats(
    model: str, methods: list[str], workload: str, conc: int, new: int, repeat: int
) -> dict[str, dict]:
    """The cell ``repeat`` times with every method (``none`` included), the order reversed
    every other time; per method the pooled figures, ``tokens`` the first run's and
    ``same_runs`` whether every run produced them."""
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(repeat):
        for method in methods if r % 2 == 0 else methods[::-1]:
            runs[method].append(run_cell(model, method, workload, conc, new))
    out = {}
    for method, mine in runs.items():
        n_tokens = sum(len(t) for t in mine[0]["tokens"]) * len(mine)
        wall, cpu = sum(x["wall_s"] for x in mine), sum(x["cpu_s"] for x in mine)
        out[method] = {
            "tok_s": n_tokens / wall,
            "cpu_tok_s": n_tokens / cpu,
            "itl_ms": 1e3 * sum(x["itl_s"] for x in mine) / len(mine),
            "accept_len": accept_len(
                sum(x["drafts"] for x in mine), sum(x["accepted"] for x in mine)
            ),
            "tokens": mine[0]["tokens"],
            "same_runs": all(x["tokens"] == mine[0]["tokens"] for x in mine),
        }
    return out


def plot(rows: list[dict]) -> None:
    from benchmarks.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for method in sorted({r["method"] for r in rows if r["method"] != "none"}):
        mine = [r for r in rows if r["method"] == method]
        labels = [f"{r['workload']}\nc={r['conc']}" for r in mine]
        ax.plot(labels, [r["speedup"] for r in mine], "o-", label=method)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("output tok/s vs no speculation")
    ax.set_title("speculative decoding speed-up")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, "spec_decode.png")


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.common import emit_json, print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, small cells")
    parser.add_argument("--model", help="model folder or .gguf (default: the default model)")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="of " + ",".join(WORKLOADS)
    )
    parser.add_argument("--conc", default="1,4,16,64", help="concurrent sessions per cell")
    parser.add_argument("--cells", help="workload:conc,... (instead of --workloads x --conc)")
    parser.add_argument("--methods", default="suffix", help="of ngram,suffix (against none)")
    parser.add_argument("--new", type=int, default=64, help="generated tokens per turn")
    parser.add_argument(
        "--new-at-load", type=int, default=32, help="generated tokens per turn at 16+ sessions"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each cell per method (order alternating)"
    )
    parser.add_argument("--no-warm-up", action="store_true", help="skip the unmeasured first pass")
    args = parser.parse_args(argv)
    if args.smoke:
        from worker.model.build_tiny import build_tiny_model

        args.model = args.model or str(build_tiny_model(None, "llama", "tiny", 0))
        args.cells = args.cells or "edit:1,edit:4,json:4,agentic:2,chat:4"
        args.methods, args.new, args.repeat, args.no_warm_up = "ngram,suffix", 12, 1, True
    if args.model is None:
        from worker.model.default_model import default_model_path

        args.model = str(default_model_path())
    if args.cells:
        cells = [(w, int(c)) for w, c in (cell.split(":") for cell in args.cells.split(","))]
    else:
        conc = [int(c) for c in args.conc.split(",")]
        cells = [(w, c) for w in args.workloads.split(",") for c in conc]
    rows, head = [], {}
    methods = ["none", *args.methods.split(",")]

    def tokens_of(conc: int) -> int:
        return args.new if conc < 16 else min(args.new, args.new_at_load)

    t0 = time.perf_counter()
    if args.repeat > 0 and not args.no_warm_up:
        workload, conc = max(cells, key=lambda c: c[1])
        run_repeats(args.model, methods, workload, conc, tokens_of(conc), 1)
    for workload, conc in cells:
        new = tokens_of(conc)
        got = run_repeats(args.model, methods, workload, conc, new, max(1, args.repeat))
        base = got["none"]
        for method in methods:
            rows.append(row_of(workload, conc, new, method, got[method], base))
            if method == "none":
                continue
            key = f"{workload}_c{conc}_{method}"
            head[f"{key}_speedup"] = round(rows[-1]["speedup"], 3)
            head[f"{key}_cpu_speedup"] = round(rows[-1]["cpu speedup"], 3)
            head[f"{key}_itl_ratio"] = round(rows[-1]["itl vs none"], 3)
            head[f"{key}_accept_len"] = round(got[method]["accept_len"], 2)
            head[f"{key}_same_tokens"] = rows[-1]["same tokens"]
    head["wall_s"] = round(time.perf_counter() - t0, 1)
    print_table(rows, f"speculative decoding, greedy ({Path(args.model).name})")
    plot(rows)
    emit_json(head)
    return head


def row_of(workload: str, conc: int, new: int, method: str, got: dict, base: dict) -> dict:
    return {
        "workload": workload,
        "conc": conc,
        "new": new,
        "method": method,
        "tok/s": got["tok_s"],
        "speedup": got["tok_s"] / base["tok_s"],
        "cpu speedup": got["cpu_tok_s"] / base["cpu_tok_s"],
        "itl ms": got["itl_ms"],
        "itl vs none": got["itl_ms"] / base["itl_ms"] if base["itl_ms"] else 1.0,
        "accept len": got["accept_len"],
        "same tokens": got["tokens"] == base["tokens"] and got["same_runs"] and base["same_runs"],
    }


if __name__ == "__main__":
    main()
