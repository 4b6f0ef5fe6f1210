"""GPU worker speed: paged kernels vs SDPA, decode step time and GPU-busy share, offline
throughput vs ``transformers``.

    python -m benchmarks.gpu_engine                 # on a CUDA GPU: the 853m model, bf16
    python -m benchmarks.gpu_engine --smoke         # tiny model; on the CPU only part 3 runs
    TRITON_INTERPRET=1 python -m benchmarks.gpu_engine --smoke   # + kernels at toy shapes

1. Decode kernel: ``paged_attention`` (Triton, split-K chosen by shape, and without split-K)
   vs ``F.scaled_dot_product_attention`` on the same K/V laid out contiguously; 32 query / 8
   KV heads, head 128, block 16, bf16. GB/s counts the K/V bytes read.
2. Prefill: the same kernel with causal chunks over the paged cache vs SDPA causal on
   contiguous K/V (TFLOP/s of the causal attention).
3. Engine: a random Llama (``--size``, default ``853m``: 16 layers, hidden 2048, 32/8 heads,
   vocab 32000) in ``--dtype``; one decode step at each ``--decode-batch`` count of running
   sequences (default 1, 32, 128: wall time and the GPU-busy share from the torch profiler's
   kernel times; the headline figures are the largest count's), then offline
   throughput on ``--requests`` prompts of 64-512 random tokens, ``--max-tokens`` out, greedy,
   all at once, vs ``transformers`` ``generate`` in static batches of ``--hf-batch``.

Targets: decode kernel within 80 % of SDPA's time at every row and >= 2 TB/s at
1 x 8192; prefill within 70 % of SDPA; decode step <= 8 ms with GPU busy >= 75 %; throughput
>= 12,000 tok/s and >= 5x transformers. The JSON line names the GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import emit_json, print_table, pyplot, save_figure
from benchmarks.engine_throughput import mixed_prompts, run_engine, run_transformers
from kvstore.requests.sampling_params import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.model.build_tiny import build_tiny_model

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DECODE_SHAPES = [(1, 8192), (8, 4096), (64, 2048), (256, 1024), (128, 4096)]
PREFILL_SHAPES = [(1, 8192), (16, 512), (4, 2048)]


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the current stream (CUDA events; wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def paged_case(batch: int, ctx: int, q_len: int, dtype, device):
    """Random K/V of ``batch`` sequences of ``ctx`` tokens in shuffled blocks, plus the same
    K/V contiguous; ``q_len`` new tokens per sequence at the end of each context."""
    gen = torch.Generator(device=device).manual_seed(0)
    per_seq = -(-ctx // PAGE)
    num_blocks = batch * per_seq
    k_cache = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, generator=gen, device=device)
    v_cache = torch.randn_like(k_cache)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = order.view(batch, per_seq)
    flat = lambda c: c[tables.long()].reshape(batch, per_seq * PAGE, KV_HEADS, HEAD_DIM)  # noqa: E731
    k_dense = flat(k_cache)[:, :ctx].transpose(1, 2).contiguous()  # [b, kv, ctx, d]
    v_dense = flat(v_cache)[:, :ctx].transpose(1, 2).contiguous()
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, seq_lens, qsl, k_dense, v_dense


def kernel_tables(
    dtype, device: str, decode_shapes=DECODE_SHAPES, prefill_shapes=PREFILL_SHAPES
) -> tuple[list[dict], list[dict]]:
    """The kernel rows; on the CPU (``TRITON_INTERPRET=1``, tiny shapes) only a check."""
    from worker.attention.triton_kernel import paged_attention

    scale = HEAD_DIM**-0.5
    decode_rows = []
    for batch, ctx in decode_shapes:
        q, kc, vc, bt, sl, qsl, kd, vd = paged_case(batch, ctx, 1, dtype, device)
        q_dense = q.view(batch, HEADS, 1, HEAD_DIM)
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * kc.element_size()

        def run(splits, q=q, kc=kc, vc=vc, bt=bt, sl=sl, qsl=qsl, ctx=ctx):
            return paged_attention(
                q, kc, vc, bt, sl, qsl, 1, scale, None, max_seq_len=ctx, num_splits=splits
            )

        t_auto, t_one = cuda_time(lambda: run(None)), cuda_time(lambda: run(1))
        t_sdpa = cuda_time(
            lambda q_dense=q_dense, kd=kd, vd=vd: F.scaled_dot_product_attention(
                q_dense, kd, vd, enable_gqa=True
            )
        )
        ref = F.scaled_dot_product_attention(q_dense, kd, vd, enable_gqa=True)
        err = (run(None).float() - ref.float().view(batch, HEADS, HEAD_DIM)).abs().max()
        decode_rows.append(
            {
                "batch x ctx": f"{batch} x {ctx}",
                "paged us": t_auto * 1e6,
                "paged GB/s": kv_bytes / t_auto / 1e9,
                "no split-K us": t_one * 1e6,
                "sdpa us": t_sdpa * 1e6,
                "sdpa GB/s": kv_bytes / t_sdpa / 1e9,
                "sdpa/paged": t_sdpa / t_auto,
                "max err": float(err),
            }
        )
    prefill_rows = []
    for batch, length in prefill_shapes:
        q, kc, vc, bt, sl, qsl, kd, vd = paged_case(batch, length, length, dtype, device)
        q_dense = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2)
        flops = 4 * batch * (length * length / 2) * HEADS * HEAD_DIM

        def run_p(q=q, kc=kc, vc=vc, bt=bt, sl=sl, qsl=qsl, length=length):
            return paged_attention(q, kc, vc, bt, sl, qsl, length, scale, None, max_seq_len=length)

        t_paged = cuda_time(run_p, iters=10)
        t_sdpa = cuda_time(
            lambda q_dense=q_dense, kd=kd, vd=vd: F.scaled_dot_product_attention(
                q_dense, kd, vd, is_causal=True, enable_gqa=True
            ),
            iters=10,
        )
        prefill_rows.append(
            {
                "batch x tokens": f"{batch} x {length}",
                "paged ms": t_paged * 1e3,
                "paged TFLOP/s": flops / t_paged / 1e12,
                "sdpa ms": t_sdpa * 1e3,
                "sdpa TFLOP/s": flops / t_sdpa / 1e12,
                "sdpa/paged": t_sdpa / t_paged,
            }
        )
    return decode_rows, prefill_rows


def decode_step(engine: Engine, batch: int, vocab: int, steps: int = 10) -> dict:
    """Wall time of one decode step with ``batch`` running sequences and the share of it the
    GPU spends in kernels (torch profiler), after the prompts are prefilled."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, min_tokens=steps + 64)
    ids = [
        engine.add_request([rng.randrange(5, vocab) for _ in range(128)], params)
        for _ in range(batch)
    ]
    for _ in range(8):  # prefill every prompt, then a few warm decode steps
        engine.step()
    cuda = engine.config.device.startswith("cuda")
    walls: list[float] = []
    busy = 0.0
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.step()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    total = sum(walls)
    return {
        "step ms": statistics.median(walls) * 1e3,
        "gpu busy": busy / total if cuda else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few seconds")
    parser.add_argument("--size", default="853m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--kv-gb", type=float, default=40.0)
    parser.add_argument(
        "--attn-backend", default="auto", help="the engine's attention backend (part 3)"
    )
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.smoke:
        args.size, args.requests, args.max_tokens = "tiny", 8, 8
        args.decode_batch, args.hf_batch, args.kv_gb = [1, 8], 4, 0.02
    if not cuda:
        args.dtype = "float32"
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name() if cuda else "none (CPU)"
    print(f"device: {gpu}; torch {torch.__version__}")
    head: dict = {"gpu": gpu, "dtype": args.dtype, "model": args.size}

    if not args.skip_kernels and (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        shapes = {} if cuda else {"decode_shapes": [(2, 64)], "prefill_shapes": [(1, 32)]}
        decode_rows, prefill_rows = kernel_tables(dtype, device, **shapes)
        print_table(decode_rows, "1. paged decode kernel vs SDPA on contiguous K/V")
        print_table(prefill_rows, "2. paged prefill (causal) vs SDPA causal on contiguous K/V")
        head["decode_kernel_min_sdpa_ratio"] = round(min(r["sdpa/paged"] for r in decode_rows), 3)
        head["decode_1x8192_gb_s"] = round(decode_rows[0]["paged GB/s"], 1)
        head["prefill_min_sdpa_ratio"] = round(min(r["sdpa/paged"] for r in prefill_rows), 3)
        plot(decode_rows)

    model_dir = build_tiny_model(None, "llama", args.size, 0)
    cfg = EngineConfig(
        device=device,
        dtype=args.dtype,
        kv_memory_bytes=int(args.kv_gb * 2**30),
        max_num_seqs=max(*args.decode_batch, 256),
        max_num_batched_tokens=8192,
        attn_backend=args.attn_backend,
    )
    engine = Engine.from_model_dir(model_dir, cfg)
    head["attn_backend"] = engine.executor.runner.backend.name
    vocab = engine.executor.vocab_size
    steps = {b: decode_step(engine, b, vocab) for b in args.decode_batch}
    step = steps[max(steps)]
    prompts = mixed_prompts(args.requests, 64, 512, vocab, 0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
    res = run_engine(engine, prompts, params)
    rows = [{"system": "engine", "tok/s": res["tok_s"], "wall s": res["wall"]}]
    head.update(
        {
            "decode_batch": max(steps),
            "decode_step_ms": round(step["step ms"], 2),
            "decode_gpu_busy": None if step["gpu busy"] is None else round(step["gpu busy"], 3),
            "decode_step_ms_by_batch": {b: round(r["step ms"], 2) for b, r in steps.items()},
            "engine_tok_s": round(res["tok_s"], 1),
        }
    )
    if not args.skip_transformers:
        hf = run_transformers(model_dir, prompts, args.max_tokens, args.hf_batch, dtype, device)
        rows.append(
            {
                "system": f"transformers b={args.hf_batch}",
                "tok/s": hf["tok_s"],
                "wall s": hf["wall"],
            }
        )
        head["transformers_tok_s"] = round(hf["tok_s"], 1)
        head["speedup_vs_transformers"] = round(res["tok_s"] / hf["tok_s"], 2)
    print_table(
        [
            {"sequences": b, "step ms": r["step ms"], "GPU busy": r["gpu busy"]}
            for b, r in steps.items()
        ],
        "3a. one decode step",
    )
    print_table(rows, f"3. offline throughput, {args.requests} requests, {args.max_tokens} out")
    emit_json(head)
    return head


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [r["batch x ctx"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["paged GB/s"] for r in rows], 0.4, label="paged (split-K)")
    ax.bar([i + 0.2 for i in x], [r["sdpa GB/s"] for r in rows], 0.4, label="SDPA contiguous")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("K/V GB/s")
    ax.set_title("decode attention bandwidth")
    ax.legend()
    save_figure(fig, "gpu_decode_kernel.png")


if __name__ == "__main__":
    main(sys.argv[1:])
