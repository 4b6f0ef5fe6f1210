"""Cost of one sampling step with penalties: incremental device counts vs a recount per step.

A batch of ``--batch`` sequences, each with a ``--prompt``-token prompt and a repetition,
frequency and presence penalty, decodes ``--steps`` tokens. Two ways to feed the sampler its
token counts, on the same logits, with the tokens checked equal at every step:

* recount (the baseline): every step passes each sequence's prompt and output ids, which
  the sampler pads, copies and scatters: O(prompt + output) per sequence and step;
* incremental (``worker.engine.penalties.PenaltyCounts``): rows filled from the prompt on the
  first step, then one new token per sequence and step: O(batch) per step.

Reported per prompt length: mean ms per step over the steps after the first (the first
builds the rows), and recount / incremental.

    .venv/bin/python -m benchmarks.penalty_counts            # prompts 1k, 8k, 32k; batch 32
    .venv/bin/python -m benchmarks.penalty_counts --smoke    # a second or two

Measured on CPU (2 shared cores busy with other jobs, ``nice -n 10``; vocab 32000, batch 32,
20 steps), ms per step; the incremental step stays flat (the penalty arithmetic over
[batch, vocab] dominates it), the recount grows with the prompt:

    prompt  recount  incremental  first step (incr.)  recount/incremental
    1,024    28.8       18.0          48.8               1.60
    8,192    44.3       19.1          76.7               2.32
    32,768  117.1       19.0         330.5               6.17
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import emit_json, print_table
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.penalties import PenaltyCounts
from worker.engine.request import Sequence
from worker.engine.sampler import SampleSpec, sample


def run_case(prompt_len: int, batch: int, steps: int, vocab: int, device: str) -> dict:
    dev = torch.device(device)
    g = torch.Generator().manual_seed(prompt_len)
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.2
    )
    prompts = [torch.randint(vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    seqs = {
        way: [Sequence(0, list(p), prompt_len, None, None) for p in prompts]
        for way in ("recount", "incremental")
    }
    counts = PenaltyCounts()
    rng = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"recount": [], "incremental": []}
    for _ in range(steps):
        logits = torch.randn((batch, vocab), generator=g).to(dev)
        picked = {}
        for way, ss in seqs.items():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if way == "recount":
                specs = [
                    SampleSpec(params, None, (), s.token_ids[: s.prompt_len], s.output_ids)
                    for s in ss
                ]
                toks, _ = sample(logits, specs, rng)
            else:
                rows = counts.rows([(s, params) for s in ss], vocab, dev)
                toks, _ = sample(logits, [SampleSpec(params, None) for _ in ss], rng, rows)
            times[way].append(time.perf_counter() - t0)
            for s, t in zip(ss, toks, strict=True):
                s.token_ids.append(t)
            picked[way] = toks
        assert picked["recount"] == picked["incremental"], "the two ways sampled differently"
    mean = {w: 1000 * sum(t[1:]) / max(1, len(t) - 1) for w, t in times.items()}
    return {
        "prompt": prompt_len,
        "batch": batch,
        "recount ms/step": round(mean["recount"], 3),
        "incremental ms/step": round(mean["incremental"], 3),
        "first step ms (incr.)": round(1000 * times["incremental"][0], 3),
        "recount/incremental": round(mean["recount"] / mean["incremental"], 2),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a second or two")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.batch, args.steps, args.vocab = [256, 2048], 8, 5, 4096
    rows = [run_case(p, args.batch, args.steps, args.vocab, args.device) for p in args.prompts]
    print_table(rows, f"penalty counts per sampling step ({args.device}, vocab {args.vocab})")
    head = {"penalty_counts_device": args.device, "penalty_counts_batch": args.batch}
    for r in rows:
        head[f"penalty_counts_p{r['prompt']}_recount_ms"] = r["recount ms/step"]
        head[f"penalty_counts_p{r['prompt']}_incremental_ms"] = r["incremental ms/step"]
        head[f"penalty_counts_p{r['prompt']}_speedup"] = r["recount/incremental"]
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
