"""Speculative acceptance a session gets on its own worker against another worker.

    python -m benchmarks.spec_routing            # default model
    python -m benchmarks.spec_routing --smoke    # tiny model, seconds

The suffix proposer's corpus is worker-local: a session's earlier answers draft its
follow-ups only on the worker that produced them, which is where prefix-aware routing sends
the follow-ups anyway (the worker holding the session's prefix). Two engines speculating
with ``suffix`` in one process stand for two workers. ``--sessions`` multi-turn sessions
(``--workload``, default ``agentic``: each turn quotes the previous answer again with a
change; ``benchmarks/spec_workloads.py``), ``--conc`` at once, each its own tenant (its own
corpus key, so only its own earlier text can draft it): every first turn runs on worker A;
the follow-up turns run on A again (``own``) or on B (``other``: B's corpus has not seen the
earlier answers, only the prompt's own copy of them can draft). Each placement runs on a
fresh pair of engines. Per placement, over the follow-up turns: mean acceptance length
(1 + accepted drafts / sequences verified, the serving engine's counters), output tokens/s
and whether the greedy tokens equal the other placement's. Table and a final JSON line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.spec_decode import accept_len, engine_of, spec_figures
from benchmarks.spec_workloads import WORKLOADS, play_turn, turns

PLACEMENTS = ("own", "other")


def run_placement(model: str, placement: str, args: argparse.Namespace) -> dict:
    from kvstore.requests.sampling_params import SamplingParams

    first = engine_of(model, "suffix", args.conc)
    follow = first if placement == "own" else engine_of(model, "suffix", args.conc)
    sessions = [turns(args.workload, i) for i in range(args.sessions)]
    params = [
        SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True, cache_salt=f"s{i}")
        for i in range(args.sessions)
    ]
    histories: list[list[dict]] = [[] for _ in sessions]
    groups = [
        list(range(lo, min(lo + args.conc, len(sessions))))
        for lo in range(0, len(sessions), args.conc)
    ]
    tokens: list[list[int]] = []
    for turn in range(max(map(len, sessions))):
        if turn == 1:  # the follow-ups from here: measure them alone
            drafts0, accepted0 = spec_figures(follow)
            t0 = time.perf_counter()
        engine = first if turn == 0 else follow
        for group in groups:
            live = [i for i in group if turn < len(sessions[i])]
            texts = [sessions[i][turn] for i in live]
            done = play_turn(engine, [histories[i] for i in live], texts, [params[i] for i in live])
            tokens += [list(c.token_ids) for c in done]
    wall = time.perf_counter() - t0
    drafts, accepted = spec_figures(follow)
    follow_tokens = sum(map(len, tokens[args.sessions :]))
    return {
        "placement": placement,
        "accept len": accept_len(drafts - drafts0, accepted - accepted0),
        "follow-up tok/s": follow_tokens / wall,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.common import emit_json, print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, small cells")
    parser.add_argument("--model", help="model folder or .gguf (default: the default model)")
    parser.add_argument("--workload", default="agentic", choices=WORKLOADS)
    parser.add_argument("--sessions", type=int, default=8, help="sessions per placement")
    parser.add_argument("--conc", type=int, default=4, help="sessions at once")
    parser.add_argument("--new", type=int, default=64, help="generated tokens per turn")
    args = parser.parse_args(argv)
    if args.smoke:
        from worker.model.build_tiny import build_tiny_model

        args.model = args.model or str(build_tiny_model(None, "llama", "tiny", 0))
        args.sessions, args.conc, args.new = 2, 2, 12
    if args.model is None:
        from worker.model.default_model import default_model_path

        args.model = str(default_model_path())
    if len(turns(args.workload, 0)) < 2:
        parser.error(f"--workload {args.workload} has one turn: no follow-ups to place")
    runs = {p: run_placement(args.model, p, args) for p in PLACEMENTS}
    same = runs["own"]["tokens"] == runs["other"]["tokens"]
    rows = [{k: v for k, v in r.items() if k != "tokens"} for r in runs.values()]
    for row in rows:
        row["same tokens"] = same
    print_table(
        rows,
        f"follow-up turns on the session's own worker vs another ({args.workload}, "
        f"{args.sessions} sessions, {args.conc} at once, {Path(args.model).name})",
    )
    head = {f"{p}_accept_len": round(r["accept len"], 3) for p, r in runs.items()}
    head |= {f"{p}_tok_s": round(r["follow-up tok/s"], 2) for p, r in runs.items()}
    head["same_tokens"] = same
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
