"""The Triton paged-attention backend against the torch backend and the dense reference.

On CUDA (``-m cuda``): kernel vs torch backend, and a whole-model comparison. Without CUDA
the same kernel runs in Triton's CPU interpreter in a subprocess (the interpreter must be
chosen before the kernel module is imported); ``triton`` is a dev dependency, so that test
is never skipped: a missing ``triton`` fails it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.model.test_paged_attention import (
    MIXED,
    assert_matches_torch_backend,
    make_scenario,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@pytest.mark.cuda
@needs_cuda
@needs_triton
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_backend_on_cuda(block_size, window, dtype):
    sc = make_scenario(
        MIXED, block_size, shared_prefix_blocks=1, seed=2, dtype=dtype, device="cuda"
    )
    assert_matches_torch_backend("triton", sc, window, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
@needs_cuda
@needs_triton
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma3"])
def test_runner_with_triton_matches_torch_on_cuda(family, model_dirs):
    from tests.model.helpers import BlockHandout
    from worker.model.runner import ModelRunner, SeqChunk

    results = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(
            model_dirs[family], device="cuda", block_size=16, num_blocks=32, attn_backend=backend
        )
        blocks = BlockHandout(runner.num_blocks)
        tables = [blocks.table(n + 1, 16) for n in (5, 40)]
        prefill = [
            SeqChunk(list(range(7, 7 + n)), 0, t, "all")
            for n, t in zip((5, 40), tables, strict=True)
        ]
        first = runner.execute(runner.build_input(prefill))
        decode = [SeqChunk([9], n, t) for n, t in zip((5, 40), tables, strict=True)]
        results[backend] = torch.cat([first, runner.execute(runner.build_input(decode))])
    torch.testing.assert_close(results["triton"], results["torch"], atol=1e-4, rtol=0)


def test_triton_kernel_in_cpu_interpreter():
    script = textwrap.dedent(
        """
        import torch
        from tests.model.test_paged_attention import MIXED, dense_reference, make_scenario
        from tests.model.triton_cpu_driver import patch_once_per_launch
        patch_once_per_launch()
        from worker.attention.base import write_kv
        from worker.attention.triton_kernel import paged_attention
        cases = [(16, None, 1), (16, 6, 1), (32, None, 1),
                 (16, None, 2), (16, 6, 3), (32, None, 4), (16, None, 7)]
        for block_size, window, splits in cases:
            sc = make_scenario(MIXED, block_size, shared_prefix_blocks=1, seed=block_size)
            meta = sc.meta_input.attention_metadata()
            write_kv(sc.k, sc.v, sc.k_cache, sc.v_cache, meta.slot_mapping)
            out = paged_attention(sc.q, sc.k_cache, sc.v_cache, meta.block_tables, meta.seq_lens,
                                  meta.query_start_loc, meta.max_query_len, 16 ** -0.5, window,
                                  num_splits=splits)
            err = (out.double() - dense_reference(sc, window)).abs().max().item()
            assert err < 1e-5, (block_size, window, splits, err)
        # Split-K on decodes over long contexts with partial last blocks; None = by shape.
        for window, splits in ((None, 3), (40, 5), (None, 16), (None, None)):
            sc = make_scenario([(300, 1), (129, 1), (17, 1)], 16, shared_prefix_blocks=2, seed=5)
            meta = sc.meta_input.attention_metadata()
            write_kv(sc.k, sc.v, sc.k_cache, sc.v_cache, meta.slot_mapping)
            out = paged_attention(sc.q, sc.k_cache, sc.v_cache, meta.block_tables, meta.seq_lens,
                                  meta.query_start_loc, 1, 16 ** -0.5, window,
                                  max_seq_len=meta.max_seq_len, num_splits=splits)
            err = (out.double() - dense_reference(sc, window)).abs().max().item()
            assert err < 1e-5, ("decode", window, splits, err)
        print("ok")
        """
    )
    _interpret(["-c", script], timeout=120)


@needs_triton
def test_split_count_follows_the_grid_and_the_context():
    from worker.attention.triton_kernel import MAX_SPLITS, choose_num_splits

    # One decode over 8k tokens: the grid is 8 programs, so the context is split (capped).
    assert choose_num_splits(1, 8, 1, 8192, 16) == MAX_SPLITS
    # Many sequences already fill the GPU: no split.
    assert choose_num_splits(256, 8, 1, 1024, 16) == 1
    # A short context is not split below MIN_PAGES_PER_SPLIT pages per part.
    assert choose_num_splits(1, 8, 1, 64, 16) == 1
    assert 1 < choose_num_splits(8, 8, 1, 4096, 16) <= MAX_SPLITS


def run_in_interpreter(check: str, model_dir: Path, dtype: str = "float32") -> None:
    driver = ["-m", "tests.model.triton_cpu_driver", check, str(model_dir), dtype]
    _interpret(driver, timeout=180, OMP_WAIT_POLICY="PASSIVE")


def _interpret(args: list[str], *, timeout: int, **env: str) -> None:
    """Run ``python args`` with Triton's CPU interpreter (and ``env``); it must print ok."""
    proc = subprocess.run(
        [sys.executable, *args],
        env=dict(os.environ, TRITON_INTERPRET="1", **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "family, dtype",
    [
        ("llama", "float32"),
        ("mistral", "float16"),
        # 7 layers in the interpreter: minutes, so with the slow tests
        pytest.param("gemma3", "float32", marks=pytest.mark.slow),
    ],
)
def test_runner_with_triton_in_cpu_interpreter(family, dtype, model_dirs):
    """Prefill, a mixed step and decodes across block boundaries, with split-K, GQA, (for
    mistral) a sliding window and 16-bit caches, (for gemma3) sliding-window and global layers
    interleaved: the runner driving the kernel gives the torch backend's logits. See
    ``tests/model/triton_cpu_driver.py`` (no bfloat16: Triton's interpreter computes it wrongly
    even in a plain load-multiply-store kernel)."""
    run_in_interpreter("runner", model_dirs[family], dtype)


def test_decode_graph_path_with_triton_in_cpu_interpreter(model_dirs):
    """Decode batches padded to a bucket through the runner's graphs (static buffers, pad
    block past ``num_blocks``, split-K fixed at capture): torch logits, real blocks intact."""
    run_in_interpreter("graphs", model_dirs["llama"])
