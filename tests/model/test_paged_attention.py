"""Paged attention backends against a dense float64 reference.

Each scenario writes the cached prefix K/V of every sequence into shuffled physical blocks
(shared prefix blocks written once), then runs one backend step over the new tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from worker.attention import (
    BackendUnavailableError,
    UnknownBackendError,
    available_backends,
    backend_names,
    create_backend,
    resolve_backend_name,
)
from worker.model.inputs import ModelInput, SeqChunk

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


@dataclass
class Scenario:
    meta_input: ModelInput  # the step's batch
    k_cache: torch.Tensor  # caches holding every sequence's cached prefix
    v_cache: torch.Tensor
    q: torch.Tensor  # new tokens' q/k/v
    k: torch.Tensor
    v: torch.Tensor
    full_k: list[torch.Tensor]  # per sequence: K/V of the whole context (prefix + new)
    full_v: list[torch.Tensor]


def make_scenario(
    specs: list[tuple[int, int]],
    block_size: int,
    shared_prefix_blocks: int = 0,
    seed: int = 0,
    dtype=torch.float32,
    device="cpu",
) -> Scenario:
    """``specs``: (cached prefix length, new tokens) per sequence. The first
    ``shared_prefix_blocks`` blocks of every sequence whose prefix covers them are the same
    physical blocks with the same content."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(p + n) // block_size) for p, n in specs) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_prefix_blocks)]
    shared_len = shared_prefix_blocks * block_size
    shared_k = torch.randn(shared_len, KV_HEADS, HEAD_DIM, generator=gen)
    shared_v = torch.randn(shared_len, KV_HEADS, HEAD_DIM, generator=gen)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    k_cache = rand(num_blocks, block_size, KV_HEADS, HEAD_DIM)  # garbage outside any context
    v_cache = rand(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    chunks, full_k, full_v, new_q, new_k, new_v = [], [], [], [], [], []
    for prefix, new in specs:
        uses_shared = prefix >= shared_len > 0
        table = list(shared) if uses_shared else []
        while len(table) * block_size < prefix + new:
            table.append(free.pop())
        ctx_k, ctx_v = (
            rand(prefix + new, KV_HEADS, HEAD_DIM),
            rand(prefix + new, KV_HEADS, HEAD_DIM),
        )
        if uses_shared:
            ctx_k[:shared_len], ctx_v[:shared_len] = shared_k, shared_v
        for pos in range(prefix):  # the cached prefix is already in the paged cache
            block, off = table[pos // block_size], pos % block_size
            k_cache[block, off], v_cache[block, off] = ctx_k[pos], ctx_v[pos]
        chunks.append(SeqChunk([0] * new, prefix, table))
        full_k.append(ctx_k)
        full_v.append(ctx_v)
        new_q.append(rand(new, HEADS, HEAD_DIM))
        new_k.append(ctx_k[prefix:])
        new_v.append(ctx_v[prefix:])

    def to(t):
        return t.to(device=device, dtype=dtype)

    return Scenario(
        ModelInput.build(chunks, block_size, device),
        to(k_cache),
        to(v_cache),
        to(torch.cat(new_q)),
        to(torch.cat(new_k)),
        to(torch.cat(new_v)),
        full_k,
        full_v,
    )


def dense_reference(sc: Scenario, window: int | None = None) -> torch.Tensor:
    """Plain causal softmax attention per sequence in float64 on contiguous K/V."""
    outs = []
    q_all = sc.q.double().cpu()
    starts = sc.meta_input.query_start_loc.tolist()
    for i, (ck, cv) in enumerate(zip(sc.full_k, sc.full_v, strict=True)):
        q = q_all[starts[i] : starts[i + 1]]  # [n, H, d]
        n, length = q.shape[0], ck.shape[0]
        k = ck.double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, d]
        v = cv.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * HEAD_DIM**-0.5
        q_pos = torch.arange(length - n, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
    return torch.cat(outs)


def make_backend(name: str, device="cpu", block_size: int = 16):
    return create_backend(
        name,
        device=device,
        block_size=block_size,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        scale=HEAD_DIM**-0.5,
    )


def run_backend(name: str, sc: Scenario, window: int | None = None) -> torch.Tensor:
    backend = make_backend(name, sc.q.device, sc.k_cache.shape[1])
    meta = sc.meta_input.attention_metadata()
    return backend.forward(sc.q, sc.k, sc.v, sc.k_cache, sc.v_cache, backend.prepare(meta), window)


def assert_matches_torch_backend(name: str, sc: Scenario, window: int | None, tol: float) -> None:
    """Backend ``name`` against the torch backend on the same scenario (the caches restored
    between the two runs) and against the dense reference."""
    k0, v0 = sc.k_cache.clone(), sc.v_cache.clone()
    expected = run_backend("torch", sc, window)
    sc.k_cache.copy_(k0)
    sc.v_cache.copy_(v0)
    got = run_backend(name, sc, window)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=0)
    torch.testing.assert_close(got.double().cpu(), dense_reference(sc, window), atol=tol, rtol=0)


# (cached prefix, new tokens): fresh prefill, decodes, chunk on a cached prefix, long prefill
MIXED = [(0, 13), (20, 1), (37, 1), (32, 5), (3, 30), (16, 16)]


CPU_BACKENDS = ["torch", "cpu"]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 6])
def test_cpu_backends_match_dense_reference(name, block_size, window):
    sc = make_scenario(MIXED, block_size, seed=block_size)
    out = run_backend(name, sc, window)
    torch.testing.assert_close(out.double(), dense_reference(sc, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("window", [None, 6, 12])
def test_adjacent_whole_prompts_of_one_length_attend_as_one_batch(name, window):
    """Runs of fresh prompts of one length go through one batched call; a prompt that breaks
    the run (another length, a cached prefix, a decode) starts a new one; a window shorter
    than the prompts sends them one by one. Every row matches the dense reference."""
    from worker.attention.torch_backend import _fresh_runs

    # (4, 17): a chunk on a cached prefix, longer than the CPU backend's decode_chunk
    specs = [(0, 9), (0, 9), (0, 9), (0, 5), (0, 5), (4, 17), (0, 5), (10, 1), (0, 9), (0, 9)]
    sc = make_scenario(specs, 4, seed=3)
    plan = make_backend(name, block_size=4).prepare(sc.meta_input.attention_metadata())
    sizes = [len(run) for run in _fresh_runs(plan.prefills)]
    assert sizes == [3, 2, 1, 1, 2] and [len(r) for r in plan.prefill_runs] == sizes
    out = run_backend(name, sc, window)
    torch.testing.assert_close(out.double(), dense_reference(sc, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_shared_prefix_blocks_are_read_by_every_sharer(name):
    specs = [(16, 1), (16, 4), (24, 1), (17, 3)]  # all cover the 2 shared 8-token blocks
    sc = make_scenario(specs, block_size=8, shared_prefix_blocks=2, seed=7)
    tables = sc.meta_input.block_tables
    assert (tables[:, :2] == tables[0, :2]).all()  # really the same physical blocks
    out = run_backend(name, sc)
    torch.testing.assert_close(out.double(), dense_reference(sc), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_new_kv_are_written_at_slot_mapping_and_nothing_else(name):
    sc = make_scenario(MIXED, block_size=4, seed=3)
    before_k, before_v = sc.k_cache.clone(), sc.v_cache.clone()
    run_backend(name, sc)
    slots = sc.meta_input.slot_mapping
    flat_k, flat_v = (
        sc.k_cache.view(-1, KV_HEADS, HEAD_DIM),
        sc.v_cache.view(-1, KV_HEADS, HEAD_DIM),
    )
    assert torch.equal(flat_k[slots], sc.k) and torch.equal(flat_v[slots], sc.v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], before_k.view_as(flat_k)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view_as(flat_v)[untouched])


def test_chunked_prefill_equals_one_shot_prefill():
    """Prefilling 29 tokens as chunks 8+8+13 on top of the growing cache gives the same
    outputs as one 29-token prefill."""
    one = make_scenario([(0, 29)], block_size=4, seed=11)
    expected = run_backend("torch", one)
    k_cache, v_cache = torch.zeros_like(one.k_cache), torch.zeros_like(one.v_cache)
    table = one.meta_input.block_tables[0].tolist()
    backend = make_backend("torch", block_size=4)
    outs, done = [], 0
    for n in (8, 8, 13):
        batch = ModelInput.build([SeqChunk([0] * n, done, table)], 4)
        rows = slice(done, done + n)
        prepared = backend.prepare(batch.attention_metadata())
        outs.append(
            backend.forward(one.q[rows], one.k[rows], one.v[rows], k_cache, v_cache, prepared)
        )
        done += n
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-6, rtol=0)


def test_unknown_backend_lists_valid_names():
    valid = "valid: auto, cpu, flashinfer, torch, triton"
    with pytest.raises(UnknownBackendError, match=f"'nope'.*{valid}"):
        make_backend("nope")
    assert backend_names() == ["cpu", "flashinfer", "torch", "triton"]


def test_triton_backend_unavailable_on_cpu_says_why():
    assert available_backends("cpu") == ["cpu", "torch"]
    with pytest.raises(
        BackendUnavailableError, match="'triton'.*needs a CUDA device.*usable here: cpu, torch"
    ):
        make_backend("triton")


def test_auto_picks_the_native_cpu_backend_on_the_cpu():
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert resolve_backend_name("torch", "cpu") == "torch"
    assert make_backend("auto").name == "cpu"


@pytest.mark.parametrize("window", [None, 6])
def test_short_chunks_on_a_cached_prefix_attend_as_decode_rows_on_the_cpu(window):
    """The CPU backend serves a speculative verify chunk (a token and its drafts on top of a
    cached prefix) with its decode kernel, one row per new token; a fresh prompt and a chunk
    longer than ``decode_chunk`` keep the prefill path. Every row matches the reference."""
    backend = make_backend("cpu", block_size=4)
    longest = backend.decode_chunk
    specs = [(20, 1), (17, 4), (0, 3), (9, longest), (30, longest + 1), (5, 2)]
    sc = make_scenario(specs, 4, seed=5)
    plan = backend.prepare(sc.meta_input.attention_metadata())
    assert len(plan.decode_lens_host) == 1 + 4 + longest + 2
    assert plan.decode_lens_host[1:5] == (18, 19, 20, 21)  # row j sees up to itself
    assert [(p.seq, p.end - p.start) for p in plan.prefills] == [(2, 3), (4, longest + 1)]
    out = run_backend("cpu", sc, window)
    torch.testing.assert_close(out.double(), dense_reference(sc, window), atol=1e-5, rtol=0)
