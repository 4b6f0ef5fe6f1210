"""Decode throughput of the paged ModelRunner vs transformers with its own KV cache (CPU).

    python -m benchmarks.model_decode            # ~100M-parameter random llama, batch 1 and 8
    python -m benchmarks.model_decode --smoke    # tiny model, a few seconds

Both sides load the same random checkpoint (built offline by ``build_tiny_model``), get the
same prompts, prefill them (untimed) and then greedily decode ``--new-tokens`` tokens, timed;
the two sides alternate for ``--rounds`` rounds and the best round of each is kept.
Ours runs through ``ModelRunner.execute`` with the paged cache and the ``torch`` attention
backend; transformers runs ``model(..., past_key_values=...)`` with its ``DynamicCache``.
Greedy tokens of the two are compared as a correctness check. Tokens/s = batch * new tokens
/ decode seconds; ``ratio`` = ours / transformers. On a shared machine pass ``--threads 1``:
with more threads than free cores, OpenMP stalls make both sides' figures noise.
"""

from __future__ import annotations

import argparse
import inspect
import random
import time

import torch

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from worker.model.build_tiny import build_tiny_model
from worker.model.runner import ModelRunner, SeqChunk


def run_ours(runner: ModelRunner, prompts: list[list[int]], new_tokens: int):
    bs = runner.block_size
    per_seq = -(-(len(prompts[0]) + new_tokens) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    logits = runner.execute(
        runner.build_input([SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    )
    tokens = [logits.argmax(-1).tolist()]
    start = time.perf_counter()
    for step in range(new_tokens - 1):
        pos = len(prompts[0]) + step
        chunks = [SeqChunk([tok], pos, t) for tok, t in zip(tokens[-1], tables, strict=True)]
        tokens.append(runner.execute(runner.build_input(chunks)).argmax(-1).tolist())
    return time.perf_counter() - start, [list(col) for col in zip(*tokens, strict=True)]


def run_hf(model, prompts: list[list[int]], new_tokens: int):
    # transformers >= 5.2x names the KV cache argument/output "cache", older "past_key_values".
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = model(torch.tensor(prompts), use_cache=True)
        cache, next_ids = out[key], out.logits[:, -1].argmax(-1)
        tokens = [next_ids.tolist()]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(next_ids[:, None], use_cache=True, **{key: cache})
            cache, next_ids = out[key], out.logits[:, -1].argmax(-1)
            tokens.append(next_ids.tolist())
        elapsed = time.perf_counter() - start
    return elapsed, [list(col) for col in zip(*tokens, strict=True)]


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    labels = [f"batch {r['batch']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [r["ours_tok_s"] for r in rows], 0.4, label="kvcluster (paged)")
    ax.bar([x + 0.2 for x in xs], [r["hf_tok_s"] for r in rows], 0.4, label="transformers")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("decode tokens / s (CPU)")
    ax.legend()
    save_figure(fig, "model_decode.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, few tokens")
    parser.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    parser.add_argument("--batch-sizes", default=None, help="default 1,8 (smoke: 1,4)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed runs per side (best kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (smoke: 1)")
    args = parser.parse_args(argv)
    threads = args.threads or (1 if args.smoke else None)
    if threads:
        torch.set_num_threads(threads)
    rounds = args.rounds or (1 if args.smoke else 3)
    size = "tiny" if args.smoke else "100m"
    prompt_len = args.prompt_len or (16 if args.smoke else 64)
    new_tokens = args.new_tokens or (8 if args.smoke else 32)
    batches = [int(b) for b in (args.batch_sizes or ("1,4" if args.smoke else "1,8")).split(",")]

    from transformers import AutoModelForCausalLM

    path = build_tiny_model(None, args.family, size)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    blocks_needed = max(batches) * -(-(prompt_len + new_tokens) // 16)
    runner = ModelRunner(path, block_size=16, num_blocks=blocks_needed)
    params = sum(p.numel() for p in runner.model.parameters())
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    rows = []
    all_match = True
    for batch in batches:
        prompts = [[rng.randrange(5, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        run_ours(runner, prompts, 2)  # warm-up both
        run_hf(hf, prompts, 2)
        ours_s, hf_s = [], []
        for _ in range(rounds):  # alternate, keep the best: robust to a busy machine
            seconds, ours_tokens = run_ours(runner, prompts, new_tokens)
            ours_s.append(seconds)
            seconds, hf_tokens = run_hf(hf, prompts, new_tokens)
            hf_s.append(seconds)
        steps = new_tokens - 1
        match = ours_tokens == hf_tokens
        all_match &= match
        rows.append(
            {
                "batch": batch,
                "ours_tok_s": batch * steps / min(ours_s),
                "hf_tok_s": batch * steps / min(hf_s),
                "ratio": min(hf_s) / min(ours_s),
                "ours_ms_step": 1000 * min(ours_s) / steps,
                "hf_ms_step": 1000 * min(hf_s) / steps,
                "greedy_match": match,
            }
        )
    print_table(
        rows,
        f"decode on CPU ({torch.get_num_threads()} threads): {args.family} {size}, "
        f"{params / 1e6:.1f}M params, prompt {prompt_len}, {new_tokens} new tokens",
    )
    plot(rows)
    headline = {"bench": "model_decode", "size": size, "params_m": round(params / 1e6, 1)}
    for r in rows:
        b = r["batch"]
        headline[f"ours_tok_s_b{b}"] = round(r["ours_tok_s"], 1)
        headline[f"hf_tok_s_b{b}"] = round(r["hf_tok_s"], 1)
        headline[f"ratio_b{b}"] = round(r["ratio"], 3)
    headline["greedy_match"] = all_match
    emit_json(headline)


if __name__ == "__main__":
    main()
