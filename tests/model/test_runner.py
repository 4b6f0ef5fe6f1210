"""ModelRunner mechanics: KV sizing, copy-on-write copies, the ModelInput builder."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import hf_logits
from worker.model.runner import KVCacheSizeError, ModelInput, ModelRunner, SeqChunk


@pytest.fixture
def runner(model_dirs) -> ModelRunner:
    return ModelRunner(model_dirs["llama"], block_size=4, num_blocks=16)


def test_kv_cache_shape_and_budget(model_dirs):
    path = model_dirs["qwen3"]  # 2 layers, 2 kv heads, head_dim 32
    runner = ModelRunner(path, block_size=8, kv_memory_bytes=100_000)
    assert runner.bytes_per_block == 2 * 2 * 8 * 2 * 32 * 4  # K+V, layers, slots, heads, dim, fp32
    assert runner.num_blocks == 100_000 // 8192 == 12
    assert len(runner.kv_caches) == 2
    assert all(k.shape == v.shape == (12, 8, 2, 32) for k, v in runner.kv_caches)
    bf16 = ModelRunner(path, dtype="bfloat16", block_size=8, kv_memory_bytes=100_000)
    assert bf16.num_blocks == 24


def test_kv_budget_errors(model_dirs):
    path = model_dirs["llama"]
    with pytest.raises(KVCacheSizeError, match="below one block"):
        ModelRunner(path, kv_memory_bytes=100)
    with pytest.raises(KVCacheSizeError, match="not both"):
        ModelRunner(path, num_blocks=4, kv_memory_bytes=10**6)
    with pytest.raises(KVCacheSizeError, match="num_blocks=0"):
        ModelRunner(path, num_blocks=0)


def test_copy_blocks_copies_every_layer_simultaneously(runner):
    for layer, (k, v) in enumerate(runner.kv_caches):
        for block in range(runner.num_blocks):
            k[block] = 100 * layer + block
            v[block] = -(100 * layer + block)
    runner.copy_blocks([(1, 2), (2, 3), (5, 9)])  # 2 -> 3 reads the *old* block 2
    for layer, (k, v) in enumerate(runner.kv_caches):
        firsts = k[:, 0, 0, 0].tolist()
        expect = [100 * layer + b for b in range(16)]
        expect[2], expect[3], expect[9] = expect[1], 100 * layer + 2, expect[5]
        assert firsts == expect
        assert torch.equal(v, -k)
    with pytest.raises(ValueError, match=r"in \[0, 16\)"):
        runner.copy_blocks([(0, 16)])
    with pytest.raises(ValueError, match="appears twice"):
        runner.copy_blocks([(0, 1), (2, 1)])


def test_copy_on_write_fork_continues_like_the_original(runner, model_dirs, hf_model):
    """Seq A has 10 tokens in blocks [3, 7, 11] (11 half full). A fork B shares 3 and 7 and
    gets a copy of 11 in 5; both then decode the same token and must agree with transformers."""
    prompt = list(range(20, 30))
    runner.execute(runner.build_input([SeqChunk(prompt, 0, [3, 7, 11])]))
    runner.copy_blocks([(11, 5)])
    logits = runner.execute(
        runner.build_input([SeqChunk([42], 10, [3, 7, 11]), SeqChunk([42], 10, [3, 7, 5])])
    )
    expected = hf_logits(hf_model(model_dirs["llama"]), prompt + [42])[-1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], expected, atol=1e-4, rtol=0)


def test_model_input_build_lays_out_a_mixed_batch():
    batch = ModelInput.build(
        [
            SeqChunk([11, 12, 13], 0, [7, 2], "last"),  # prefill
            SeqChunk([21], 5, [4, 9], "all"),  # decode at position 5 -> block 9, offset 1
            SeqChunk([31, 32], 4, [1, 6, 8], "none"),  # middle chunk of a prompt
        ],
        block_size=4,
    )
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert batch.positions.tolist() == [0, 1, 2, 5, 4, 5]
    assert batch.slot_mapping.tolist() == [28, 29, 30, 37, 24, 25]
    assert batch.query_start_loc.tolist() == [0, 3, 4, 6]
    assert batch.seq_lens.tolist() == [3, 6, 6]
    assert batch.block_tables.tolist() == [[7, 2, 0], [4, 9, 0], [1, 6, 8]]
    assert batch.block_tables.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64
    assert batch.logits_indices.tolist() == [2, 3]
    meta = batch.attention_metadata()
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs) == (3, 6, 3)


def test_model_input_build_rejects_bad_chunks():
    with pytest.raises(ValueError, match="holds 4 tokens, needs 5"):
        ModelInput.build([SeqChunk([1, 2], 3, [0])], block_size=4)
    with pytest.raises(ValueError, match="want_logits='first'"):
        ModelInput.build([SeqChunk([1], 0, [0], "first")], block_size=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 1 new token"):
        ModelInput.build([SeqChunk([], 0, [0])], block_size=4)


def test_execute_returns_only_requested_rows(runner):
    batch = runner.build_input(
        [SeqChunk([5, 6, 7], 0, [0], "none"), SeqChunk([8, 9], 0, [1], "all")]
    )
    logits = runner.execute(batch)
    assert logits.shape == (2, runner.config.vocab_size) and logits.dtype == torch.float32
