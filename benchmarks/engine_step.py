"""Where an engine step's time goes, per stage, and offline throughput, against a baseline tree.

    python -m benchmarks.engine_step                          # light + 32m, 32/128/256 seqs
    python -m benchmarks.engine_step --baseline /work/main    # and the same cells on that tree
    python -m benchmarks.engine_step --smoke                  # tiny model, a few seconds
    python -m benchmarks.engine_step --rows-only              # the rows curve alone

Rows curve (``--rows``, default 1,2,4,8,16; model ``--rows-model``, default the served
default model, SmolLM2-135M GGUF): the time of one engine step against the rows its forward
computes, two ways. ``decode``: N sequences each decoding one token (a decode batch).
``extend``: one sequence computing N new tokens after a cached prefix, logits for every row
(a speculative verify step, a short prefill chunk). Median wall ms of ``--rows-steps`` steps,
and the ratio to one row; with ``--threads 1`` the steps are timed in the calling thread's CPU
time (the offline engine runs there), robust to a busy machine. Drawn to
``engine_step_rows.png``; keys ``rows_<N>_decode_ms``, ``rows_<N>_extend_ms`` in the final
JSON line.

Workload (one cell): ``--seqs`` prompts of ``--prompt`` random token ids (fresh ids each run,
so no prefix hit), ``--new`` tokens each, greedy with ``ignore_eos``, all submitted at once,
``Engine.generate`` to completion (``max_num_seqs`` = the cell's sequences, a 4096-token
step budget, as vLLM's CPU defaults for ``LLM``). Models: ``light`` (random Llama, hidden 256,
2 layers, 4 query / 2 KV heads of 64, vocab 8192: small compute, so host costs show as next
to a GPU) and ``32m`` (``build_tiny``'s 32M-parameter Llama).

Every cell runs in a fresh process (a warm-up generate, then the measured one), the
baseline's right after this tree's, so both see the same machine load. Reported per cell:
generated tok/s (wall), the process's CPU seconds, steps, and from the engine's stage
timers (``EngineSnapshot.stage_seconds``) the mean ms per step of each stage: ``schedule``,
``prepare`` (model input), ``forward`` (the model), ``sample``, ``process`` (stops,
detokenization, applying tokens), ``output`` (RequestOutputs); ``host`` = all but forward,
and its share of the step. A baseline tree without stage timers reports throughput only.
Greedy tokens of both trees are compared cell by cell (the same ids must come out).

``--host-only`` measures the engine's own per-step host work alone, robustly on a busy
machine: the model's forward returns rows of a fixed random table (input preparation,
sampling, stops, detokenization and outputs all run as usual), one thread, and the stage
timers read the engine thread's CPU time instead of the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("schedule", "prepare", "forward", "sample", "process", "output")


def cell(
    model: str, seqs: int, prompt: int, new: int, seed: int, threads: int, host_only: bool = False
) -> dict:
    """One measured offline run in this process (the code on ``sys.path``)."""
    import hashlib
    import importlib
    import random
    import time

    if host_only:  # the stage timers read this thread's CPU time: robust to a busy machine
        time.perf_counter = time.thread_time

    importlib.import_module("worker")  # before torch: the worker's OpenMP wait policy
    import torch

    if threads:
        torch.set_num_threads(threads)
    from kvstore.requests.sampling_params import SamplingParams
    from worker.engine import Engine, EngineConfig

    path = Path(model)
    cfg = EngineConfig(
        max_num_seqs=max(seqs, 1),
        max_num_batched_tokens=max(4096, seqs),
        kv_memory_bytes=1 << 30,
        enable_prefix_caching=True,
    )
    engine = Engine.from_model_dir(path, cfg)
    vocab = engine.executor.vocab_size
    if host_only:
        fixed_logits(engine)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    warm = [[rng.randrange(5, vocab) for _ in range(prompt)] for _ in range(min(seqs, 8))]
    engine.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    prompts = [[rng.randrange(5, vocab) for _ in range(prompt)] for _ in range(seqs)]
    before = getattr(engine.snapshot(), "stage_seconds", None)
    steps0 = engine.snapshot().num_steps
    wall0, cpu0 = time.perf_counter(), time.process_time()
    results = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    snap = engine.snapshot()
    tokens = [c.token_ids for r in results for c in r.completions]
    out = {
        "tok_s": sum(map(len, tokens)) / wall,
        "wall_s": wall,
        "cpu_s": cpu,
        "steps": snap.num_steps - steps0,
        "threads": torch.get_num_threads(),
        "tokens_sha": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
    }
    if before is not None:
        out["ms"] = snap.stage_seconds.minus(before).per_step_ms()
    return out


def rows_cell(model: str, rows: list[int], steps: int, threads: int) -> dict:
    """Median ms of an engine step per row count: decode batches and one-sequence extends."""
    import importlib
    import random
    import statistics
    import time

    importlib.import_module("worker")
    import torch

    if threads:
        torch.set_num_threads(threads)
    from kvstore.requests.sampling_params import SamplingParams
    from worker.engine import Engine, EngineConfig
    from worker.model.inputs import SeqChunk

    top = max(rows)
    cfg = EngineConfig(max_num_seqs=top, kv_memory_bytes=1 << 28, enable_prefix_caching=True)
    engine = Engine.from_model_dir(Path(model), cfg)
    vocab = engine.executor.vocab_size
    runner = engine.executor.runner
    rng = random.Random(0)
    clock = time.thread_time if threads == 1 else time.perf_counter
    out: dict = {"decode": {}, "extend": {}}
    for n in rows:
        params = SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True)
        for _ in range(n):
            engine.add_request([rng.randrange(5, vocab) for _ in range(32)], params)
        engine.step()  # the prefills
        engine.step()  # a first decode, off the clock
        times = []
        for _ in range(steps):
            t0 = clock()
            engine.step()
            times.append(clock() - t0)
        while engine.has_unfinished_requests():
            engine.step()
        out["decode"][n] = statistics.median(times) * 1e3
    # Extends straight on the runner: 64 prefix tokens in blocks 0..3, then n new tokens.
    block = runner.block_size
    prefix = 64
    blocks = list(range(-(-(prefix + top) // block)))
    ids = [rng.randrange(5, vocab) for _ in range(prefix + top)]
    # (the engine is done: its blocks are free to overwrite)
    first = runner.build_input([SeqChunk(ids[:prefix], 0, blocks)])
    runner.execute(first)
    for n in rows:
        batch = runner.build_input(
            [SeqChunk(ids[prefix : prefix + n], prefix, blocks, want_logits="all")]
        )
        runner.execute(batch)
        times = []
        for _ in range(steps):
            t0 = clock()
            runner.execute(batch)
            times.append(clock() - t0)
        out["extend"][n] = statistics.median(times) * 1e3
    out["threads"] = torch.get_num_threads()
    return out


def run_rows(tree: Path, args: argparse.Namespace, model: str) -> dict:
    """``rows_cell`` in a fresh process on the code of ``tree``."""
    spec = [model, [int(r) for r in args.rows.split(",")], args.rows_steps, args.threads]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rows-cell", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=tree)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CELL ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"rows curve on {tree} failed:\n{proc.stderr[-2000:]}")
    got = json.loads(line[len("CELL ") :])
    return {kind: {int(k): v for k, v in got[kind].items()} for kind in ("decode", "extend")}


def plot_rows(curves: dict[str, dict]) -> None:
    from benchmarks.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for tree, curve in curves.items():
        for kind, style in (("decode", "o-"), ("extend", "s--")):
            xs = sorted(curve[kind])
            ax.plot(xs, [curve[kind][x] for x in xs], style, label=f"{tree} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows in the forward")
    ax.set_ylabel("ms per step (median)")
    ax.set_title("engine step time against rows")
    ax.legend(fontsize=8)
    save_figure(fig, "engine_step_rows.png")


def rows_section(args: argparse.Namespace, trees: list[tuple[str, Path]], head: dict) -> None:
    model = args.rows_model or default_model()
    curves = {label: run_rows(tree, args, model) for label, tree in trees}
    rows = []
    for label, curve in curves.items():
        for n in sorted(curve["decode"]):
            dec, ext = curve["decode"][n], curve["extend"][n]
            rows.append(
                {
                    "tree": label,
                    "rows": n,
                    "decode ms": dec,
                    "decode x1": dec / curve["decode"][min(curve["decode"])],
                    "extend ms": ext,
                    "extend x1": ext / curve["extend"][min(curve["extend"])],
                }
            )
            prefix = "rows" if label == "this" else "baseline_rows"
            head[f"{prefix}_{n}_decode_ms"] = round(dec, 2)
            head[f"{prefix}_{n}_extend_ms"] = round(ext, 2)
    from benchmarks.common import print_table

    print_table(rows, f"step time against rows ({Path(model).name})")
    plot_rows(curves)


def default_model() -> str:
    from worker.model.default_model import default_model_path

    return str(default_model_path())


def fixed_logits(engine: object) -> None:
    """Replace the model's forward by rows of a fixed random table (the input is still
    built, sampled from, detokenized): what is left of a step is the engine's host work."""
    import torch

    runner = engine.executor.runner  # type: ignore[attr-defined]
    table = torch.randn(
        4096, engine.executor.vocab_size, generator=torch.Generator().manual_seed(0)
    )  # type: ignore[attr-defined]
    at = [0]

    def execute(batch: object, adapters: object = None) -> torch.Tensor:
        n = batch.logits_indices.shape[0]  # type: ignore[attr-defined]
        at[0] = (at[0] + 7) % (table.shape[0] - n)
        return table[at[0] : at[0] + n]

    runner.execute = execute


def model_folder(model: str) -> str:
    """A model folder, or a ``build_tiny`` size built (cached) by this tree."""
    if Path(model).exists():
        return model
    from worker.model.build_tiny import build_tiny_model

    return str(build_tiny_model(None, "llama", model, 0))


def run_cell(tree: Path, args: argparse.Namespace, model: str, seqs: int) -> dict:
    """``cell`` in a fresh process on the code of ``tree``."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--cell",
        json.dumps([model, seqs, args.prompt, args.new, args.seed, args.threads, args.host_only]),
    ]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=tree)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CELL ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"cell {model}/{seqs} on {tree} failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[len("CELL ") :])


def row_of(model: str, seqs: int, tree: str, res: dict) -> dict:
    row = {"model": model, "seqs": seqs, "tree": tree, "tok/s": res["tok_s"]}
    row |= {"wall s": res["wall_s"], "cpu s": res["cpu_s"], "steps": res["steps"]}
    ms = res.get("ms")
    for name in (*STAGES, "host"):
        row[f"{name} ms"] = ms[name] if ms else "-"
    row["host share"] = ms["host"] / ms["total"] if ms and ms["total"] else "-"
    return row


def plot(rows: list[dict]) -> None:
    from benchmarks.common import pyplot, save_figure

    mine = [r for r in rows if r["tree"] == "this" and r["schedule ms"] != "-"]
    if not mine:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']}\n{r['seqs']} seqs" for r in mine]
    bottom = [0.0] * len(mine)
    for name in STAGES:
        vals = [r[f"{name} ms"] for r in mine]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("ms per engine step")
    ax.set_title("engine step by stage (offline generate)")
    ax.legend(fontsize=8)
    save_figure(fig, "engine_step.png")


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.common import emit_json, print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, small cells")
    parser.add_argument("--models", default="light,32m", help="build_tiny sizes or folders")
    parser.add_argument("--seqs", default="32,128,256", help="sequences per cell")
    parser.add_argument("--prompt", type=int, default=128, help="prompt token ids")
    parser.add_argument("--new", type=int, default=64, help="generated tokens per sequence")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", help="another checkout (e.g. main) run on the same cells")
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="the forward replaced by fixed logits, stages timed in engine-thread CPU time",
    )
    parser.add_argument("--rows", default="1,2,4,8,16", help="row counts of the rows curve")
    parser.add_argument("--rows-steps", type=int, default=9, help="steps timed per row count")
    parser.add_argument("--rows-model", help="model of the rows curve (default: the default)")
    parser.add_argument("--rows-only", action="store_true", help="only the rows curve")
    parser.add_argument("--no-rows", action="store_true", help="skip the rows curve")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.seqs, args.prompt, args.new = "tiny", "8", 16, 4
        args.rows, args.rows_steps = "1,2,4", 2
        args.rows_model = args.rows_model or model_folder("tiny")
    if args.host_only:
        args.threads = 1  # all of the host work on the timed thread
    trees = [("this", ROOT)] + ([("baseline", Path(args.baseline))] if args.baseline else [])
    rows, head = [], {}
    if not args.no_rows:
        rows_section(args, trees, head)
    for model in [] if args.rows_only else args.models.split(","):
        name = Path(model).name
        folder = model_folder(model)  # one folder for both trees
        for seqs in map(int, args.seqs.split(",")):
            got = {label: run_cell(tree, args, folder, seqs) for label, tree in trees}
            rows += [row_of(name, seqs, label, res) for label, res in got.items()]
            this = got["this"]
            key = f"{name}_{seqs}"
            head[f"{key}_tok_s"] = round(this["tok_s"], 1)
            if "ms" in this:
                head[f"{key}_host_ms"] = round(this["ms"]["host"], 3)
                head[f"{key}_host_share"] = round(this["ms"]["host"] / this["ms"]["total"], 3)
            if "baseline" in got:
                base = got["baseline"]
                head[f"{key}_baseline_tok_s"] = round(base["tok_s"], 1)
                head[f"{key}_speedup"] = round(this["tok_s"] / base["tok_s"], 3)
                head[f"{key}_cpu_ratio"] = round(base["cpu_s"] / this["cpu_s"], 3)
                head[f"{key}_same_tokens"] = this["tokens_sha"] == base["tokens_sha"]
    if rows:
        print_table(rows, f"offline generate, {args.prompt} prompt ids, {args.new} new tokens each")
        plot(rows)
    emit_json(head)
    return head


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--cell":
        print("CELL " + json.dumps(cell(*json.loads(sys.argv[2]))), flush=True)
    elif len(sys.argv) == 3 and sys.argv[1] == "--rows-cell":
        print("CELL " + json.dumps(rows_cell(*json.loads(sys.argv[2]))), flush=True)
    else:
        main()
