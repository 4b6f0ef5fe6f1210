"""The native CPU decode kernel (worker/attention/csrc/paged_decode.c) against the torch
reference backend, over the shapes the reference scenarios do not reach: GQA groups of 1..8,
head dims on the 16-wide paths (multiples of 16, whole and partial 64-dim tiles) and not a
multiple of the kernel's 8-wide dot product, non-contiguous q (the
model passes views of its fused q/k/v projection), windows, and every thread split.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from worker.attention import create_backend, native
from worker.attention.native import split_items
from worker.model.inputs import ModelInput, SeqChunk

pytestmark = pytest.mark.skipif(
    native.load_kernels() is None, reason=f"no native kernels: {native.unavailable_reason()}"
)


def decode_batch(lens: list[int], block_size: int, num_blocks: int, seed: int) -> ModelInput:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for length in lens:
        table = [free.pop() for _ in range(-(-length // block_size))]
        chunks.append(SeqChunk([1], length - 1, table))
    return ModelInput.build(chunks, block_size)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # 64, 128, 80, 256: the 16-wide paths (whole and partial 64-dim tiles); the rest the 8-wide
    [(4, 4, 64), (6, 2, 36), (8, 1, 8), (16, 2, 128), (3, 1, 5), (4, 2, 80), (4, 1, 256)],
)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("q_scale", [1.0, 40.0])  # 40: scores spanning far past exp's range
def test_kernel_matches_torch_reference(heads, kv_heads, head_dim, window, q_scale):
    block_size, num_blocks = 16, 200
    lens = [1, 2, 15, 16, 17, 100, 333, 64]
    batch = decode_batch(lens, block_size, num_blocks, seed=heads * head_dim)
    gen = torch.Generator().manual_seed(heads)
    cache = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) for _ in "kv"]
    # q as a strided view, like the model's slice of its fused q/k/v projection
    fused = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=gen)
    fused[:, :heads] *= q_scale
    q = fused[:, :heads]
    k, v = fused[:, heads : heads + kv_heads], fused[:, heads + kv_heads :]
    outs = {}
    for name in ("torch", "cpu"):
        backend = create_backend(
            name,
            device="cpu",
            block_size=block_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5,
        )
        kc, vc = cache[0].clone(), cache[1].clone()
        outs[name] = backend.forward(
            q, k, v, kc, vc, backend.prepare(batch.attention_metadata()), window
        )
    # large scores carry float32 error ~ their magnitude in both (the softmax amplifies it)
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=2e-6 * q_scale, rtol=1e-5)


def test_split_items_covers_every_item_once_and_balances_context():
    lens = [5, 500, 7, 300, 300, 1, 90]
    for parts in (1, 2, 3, 8, 50):
        spans = split_items(lens, parts)
        covered = [i for lo, hi in spans for i in range(lo, hi)]
        assert covered == list(range(len(lens)))
        assert len(spans) <= parts
    work = [sum(lens[lo:hi]) for lo, hi in split_items(lens, 2)]
    assert work == [512, 691]  # cut at the item boundary nearest half the total


def test_loading_the_kernels_leaves_the_process_float_state_alone():
    """A library built with -ffast-math turns on flush-to-zero for the whole process when it
    is loaded; subnormals must still exist after the kernels are (they are, at import)."""
    assert native.load_kernels() is not None
    assert sys.float_info.min / 2 > 0
    assert torch.tensor(sys.float_info.min, dtype=torch.float64).div(2).item() > 0
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0  # a float32 subnormal


def test_missing_compiler_is_reported_and_auto_falls_back_to_torch(tmp_path):
    code = (
        "from worker.attention import native, resolve_backend_name\n"
        "print(native.load_kernels() is None)\n"
        "print(resolve_backend_name('auto', 'cpu'))\n"
        "print(native.unavailable_reason())\n"
    )
    env = {**os.environ, "CC": "/nonexistent/cc", "KVCLUSTER_CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "True" and out[1] == "torch"
    assert "/nonexistent/cc" in out[2] and "paged_decode.c" in out[2]


@pytest.mark.parametrize("width", [1, 7, 8, 31, 32, 33, 100, 8192])
def test_argmax_kernel_matches_torch(width):
    """The greedy sampler's row argmax: torch's answer on ties (the first maximum), -inf rows,
    infinities and NaN (the first NaN wins), on a strided view too."""
    kernels = native.load_kernels()
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(12, width + 3, generator=gen)[:, 2 : 2 + width]  # row stride != width
    x[1] = float("-inf")
    x[2] = 0.5  # all tied: index 0
    x[3, width // 2] = x[3, width - 1] = 1e9  # tied maximum: the first
    x[4, width - 1] = float("inf")
    x[5, width // 3] = float("nan")
    x[5, width - 1] = float("nan")
    x[6, 0] = float("nan")
    x[7, width - 1] = float("nan")
    x[8, width // 2] = float("inf")
    x[8, width - 1] = float("nan")
    got = kernels.argmax_rows(x)
    assert got.dtype == torch.long
    assert got.tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("threads", [2, 3])
def test_argmax_kernel_split_over_threads_matches_torch(threads):
    """A batch large enough to split its rows over the pool (uneven ranges, a strided view,
    NaN / infinity rows at the cuts) gives torch's answer for every row."""
    kernels = native.load_kernels()
    before = kernels.threads
    gen = torch.Generator().manual_seed(threads)
    rows, width = 101, 8192
    assert rows * width >= native.ARGMAX_SPLIT_ELEMENTS
    x = torch.randn(rows, width + 5, generator=gen)[:, 3 : 3 + width]
    for r in (0, rows // threads, rows // threads + 1, rows - 1):
        x[r, r % width] = float("nan") if r % 2 else float("inf")
    x[rows // 2] = float("-inf")
    try:
        kernels.set_threads(threads)
        got = kernels.argmax_rows(x)
    finally:
        kernels.set_threads(before)
    assert got.tolist() == x.argmax(dim=-1).tolist()
