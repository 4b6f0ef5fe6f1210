"""Decode steps through the graphs' static, padded buffers give the eager logits.

On the CPU the padded static-buffer path runs eagerly (``capture=False``): it checks the
padding (pad block writes touch no real block, padded rows dropped, tables wider than the
batch's). On CUDA the captured graphs themselves are compared with eager steps.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import BlockHandout
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.runner import ModelRunner, SeqChunk


def decode_batches(runner: ModelRunner, lengths, blocks: BlockHandout):
    tables = [blocks.table(n + 1, runner.block_size) for n in lengths]
    prompts = [SeqChunk(list(range(3, 3 + n)), 0, t) for n, t in zip(lengths, tables, strict=True)]
    runner.execute(runner.build_input(prompts))
    return [SeqChunk([7 + i], n, t) for i, (n, t) in enumerate(zip(lengths, tables, strict=True))]


def test_static_padded_path_equals_eager(model_dirs):
    runner = ModelRunner(model_dirs["llama"], block_size=4, num_blocks=64, attn_backend="torch")
    pad = runner.num_blocks - 1  # never handed out below
    blocks = BlockHandout(pad)
    graphs = DecodeGraphs(
        runner._logits_of_all_rows,
        device=runner.device,
        block_size=4,
        max_blocks_per_seq=16,
        pad_block=pad,
        buckets=(1, 4, 8),
        capture=False,
    )
    for lengths in ([5], [3, 9, 17], [1, 2, 3, 4, 5, 6]):
        chunks = decode_batches(runner, lengths, blocks)
        batch = runner.build_input(chunks)
        assert graphs.can_run(batch)
        before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        eager = runner.execute(batch)
        after_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        got = graphs.run(batch)
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=0)
        for (k, v), (ke, ve) in zip(runner.kv_caches, after_eager, strict=True):
            # real blocks agree up to GEMM-shape noise: padded rows wrote only the pad block
            torch.testing.assert_close(k[:pad], ke[:pad], atol=1e-5, rtol=0)
            torch.testing.assert_close(v[:pad], ve[:pad], atol=1e-5, rtol=0)
    prefill = runner.build_input([SeqChunk([1, 2], 0, blocks.table(2, 4))])
    assert not graphs.can_run(prefill)  # prefill runs eagerly
    assert graphs.replays == 3


def test_capture_warm_up_writes_only_the_pad_block(model_dirs):
    """Capture warms each bucket up by running the static buffers as they are before any
    batch: every row must be a padding row then, or the warm-up writes K/V into block 0."""
    runner = ModelRunner(model_dirs["llama"], block_size=4, num_blocks=8, attn_backend="torch")
    pad = runner.num_blocks - 1
    graphs = DecodeGraphs(
        runner._logits_of_all_rows,
        device=runner.device,
        block_size=4,
        max_blocks_per_seq=4,
        pad_block=pad,
        buckets=(1, 4),
        capture=False,
    )
    with torch.inference_mode():
        for size in (4, 1):
            graphs.step_on_static(size)
    for k, v in runner.kv_caches:
        assert not k[:pad].any() and not v[:pad].any()  # real blocks still zero
        assert k[pad].any() and v[pad].any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_equal_eager_on_cuda(model_dirs, dtype):
    pytest.importorskip("triton")
    results = {}
    for graphs_on in (False, True):
        runner = ModelRunner(
            model_dirs["llama"],
            device="cuda",
            dtype=dtype,
            block_size=16,
            num_blocks=64,
            attn_backend="triton",
            cuda_graph_max_batch=32 if graphs_on else 0,
        )
        assert (runner.graphs is not None) == graphs_on
        blocks = BlockHandout(runner.num_blocks)
        outs = []
        for lengths in ([5], [3, 40, 17], list(range(1, 30))):
            outs.append(runner.execute(runner.build_input(decode_batches(runner, lengths, blocks))))
        if graphs_on:
            assert runner.graphs.replays == 3
        results[graphs_on] = torch.cat(outs)
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(results[True], results[False], atol=tol, rtol=0)
