"""Draft-free speculative decoding (n-gram, suffix) against none, offline engine.

    python -m benchmarks.spec_decode            # default model, concurrency 1/4/16/64
    python -m benchmarks.spec_decode --smoke    # tiny model, a few seconds

Workloads (greedy, ``--new`` tokens each): ``edit`` (rewrite a given function with one
change: the answer repeats the prompt), ``json`` (tool-call JSON with a repeated shape),
``agentic`` (multi-turn: each turn's prompt carries the previous turns and answers, so the
suffix corpus has seen them) and ``chat`` (plain questions, little to copy). Per workload,
concurrency and method: output tokens/s (wall), mean inter-token latency (the engine's ITL),
mean acceptance length (tokens per verify: 1 + accepted drafts / drafts), the speed-up over
``none`` in the same process, and whether the greedy tokens equal ``none``'s. Every method
runs on a fresh engine of one process, one after another. Table, ``spec_decode.png`` (speed-up
per workload and concurrency) and a final JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import time

FUNCTION = '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''

TOOLS = (
    '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}, '
    '{"name": "get_weather", "arguments": {"city": "Madrid", "unit": "celsius"}}'
)


def prompts(workload: str, i: int) -> list[str]:
    """The turns of one session of ``workload`` (one prompt unless agentic)."""
    if workload == "edit":
        name = ["window", "size", "width", "span"][i % 4]
        return [
            f"Rewrite this function, renaming the parameter `window` to `{name}`; change "
            f"nothing else and output only the code.\n\n{FUNCTION}\n"
        ]
    if workload == "json":
        city = ["Rome", "Oslo", "Lisbon", "Vienna"][i % 4]
        return [f"Continue the list of tool calls with one for {city}, same format:\n{TOOLS}, "]
    if workload == "agentic":
        base = f"You are a coding agent. The file is:\n{FUNCTION}\n"
        return [
            base + "Step 1: print the function unchanged.\n",
            base + "Step 2: print it again, with a docstring example added.\n",
        ]
    topics = ["tides", "volcanoes", "bread", "comets", "bees", "glaciers", "rust", "jazz"]
    return [f"Explain in a few sentences how {topics[i % len(topics)]} work."]


def run_cell(model: str, method: str, workload: str, conc: int, new: int) -> dict:
    importlib.import_module("worker")
    from kvstore.requests.sampling_params import SamplingParams
    from worker.engine import Engine, EngineConfig

    cfg = EngineConfig(
        max_num_seqs=max(conc, 1),
        max_num_batched_tokens=max(2048, conc * 8),
        kv_memory_bytes=1 << 29,
        enable_prefix_caching=True,
        speculative={"method": method},
    )
    engine = Engine.from_model_dir(model, cfg)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    engine.generate(["warm up"], SamplingParams(temperature=0, max_tokens=2))
    sessions = [prompts(workload, i) for i in range(conc)]
    tokens: list[list[int]] = []
    produced = 0
    t0 = time.perf_counter()
    history: list[list[dict]] = [[] for _ in range(conc)]
    for turn in range(max(map(len, sessions))):
        live = [i for i, s in enumerate(sessions) if turn < len(s)]
        for i in live:
            history[i].append({"role": "user", "content": sessions[i][turn]})
        results = engine.generate([encode(engine, history[i]) for i in live], params)
        for i, r in zip(live, results, strict=True):
            c = r.completions[0]
            tokens.append(list(c.token_ids))
            produced += len(c.token_ids)
            history[i].append({"role": "assistant", "content": c.text})
    wall = time.perf_counter() - t0
    snap = engine.metrics()
    drafts = getattr(snap, "spec_decode_num_drafts", 0)
    accepted = getattr(snap, "spec_decode_num_accepted_tokens", 0)
    return {
        "tok_s": produced / wall,
        "itl_ms": snap.itl.mean * 1e3,
        "accept_len": 1 + accepted / drafts if drafts else 1.0,
        "tokens": tokens,
    }


def encode(engine: object, messages: list[dict]) -> list[int] | str:
    """The conversation as the model's chat template renders it (plain text without one)."""
    tok = engine.tokenizer  # type: ignore[attr-defined]
    if getattr(tok, "chat_template", None):
        return tok.encode(tok.render_chat(messages), add_special_tokens=False)
    return "\n".join(m["content"] for m in messages)


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
    parser.add_argument("--workloads", default="edit,json,agentic,chat")
    parser.add_argument("--conc", default="1,4,16,64", help="concurrent sessions per cell")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--new", type=int, default=96, help="generated tokens per turn")
    args = parser.parse_args(argv)
    if args.smoke:
        from worker.model.build_tiny import build_tiny_model

        args.model = args.model or str(build_tiny_model(None, "llama", "tiny", 0))
        args.workloads, args.conc, args.new = "edit,chat", "1,4", 12
    if args.model is None:
        from worker.model.default_model import default_model_path

        args.model = str(default_model_path())
    rows, head = [], {}
    for workload in args.workloads.split(","):
        for conc in map(int, args.conc.split(",")):
            base = run_cell(args.model, "none", workload, conc, args.new)
            rows.append(row_of(workload, conc, "none", base, base))
            for method in args.methods.split(","):
                got = run_cell(args.model, method, workload, conc, args.new)
                rows.append(row_of(workload, conc, method, got, base))
                key = f"{workload}_c{conc}_{method}"
                head[f"{key}_speedup"] = round(rows[-1]["speedup"], 3)
                head[f"{key}_accept_len"] = round(got["accept_len"], 2)
                head[f"{key}_same_tokens"] = got["tokens"] == base["tokens"]
    print_table(rows, f"speculative decoding, greedy, {args.new} new tokens per turn")
    plot(rows)
    emit_json(head)
    return head


def row_of(workload: str, conc: int, method: str, got: dict, base: dict) -> dict:
    return {
        "workload": workload,
        "conc": conc,
        "method": method,
        "tok/s": got["tok_s"],
        "itl ms": got["itl_ms"],
        "accept len": got["accept_len"],
        "speedup": got["tok_s"] / base["tok_s"],
        "same tokens": got["tokens"] == base["tokens"],
    }


if __name__ == "__main__":
    main()
