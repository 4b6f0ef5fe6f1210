"""The Triton backend driven by the runner and the decode graphs, in Triton's CPU interpreter.

Run as ``TRITON_INTERPRET=1 python -m tests.model.triton_cpu_driver CHECK MODEL_DIR`` (the
interpreter must be chosen before ``triton`` is imported, hence a subprocess; see
``test_triton_backend.py``). The product refuses ``triton`` and graphs off CUDA; here, and
only in this process, those two checks are patched so the CPU runs the exact code a GPU would
(the graphs' ``capture=False`` static-buffer path stands in for the replay). Each check compares
logits with a ``torch``-backend runner fed the same tokens and block tables, and prints ``ok``.
"""

from __future__ import annotations

import sys

import torch

from tests.model.helpers import BlockHandout
from worker.attention import triton_kernel
from worker.attention.triton_backend import TritonAttentionBackend
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.runner import ModelRunner, SeqChunk

BLOCK = 16
DTYPE = "float32"  # or "float16" (argv[3]); the interpreter mis-computes bfloat16
TOL = {"float32": 1e-4, "float16": 2e-2}
SPLITS: list[int] = []  # split-K counts the kernel chose, to show split-K ran


def patch_once_per_launch() -> None:
    """Triton's interpreter re-patches ``triton.language`` (``inspect.getmembers`` over its
    modules) on every call of a jit'd helper (``tl.max``, ``tl.sum``, ...), once per program
    of the grid: most of a small kernel's interpreted time. Within one launch the first such
    patch of a module's globals already holds for the rest (the launch restores its own patches
    at its end), so later ones are skipped; the kernel runs the same interpreted operations."""
    from triton.runtime import interpreter

    real = interpreter._patch_lang
    patched: set[int] = set()  # id(fn.__globals__) patched during the current launch
    launch = interpreter.GridExecutor.__call__

    def _patch_lang(fn):  # noqa: ANN001, ANN202 - Triton's signature
        key = id(fn.__globals__)
        if key in patched:
            return interpreter._LangPatchScope()  # nothing to restore
        patched.add(key)
        return real(fn)

    def call(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        patched.clear()  # a launch patches again (the previous one restored its patches)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = call


def allow_cpu() -> None:
    """Let ``triton`` and the decode graphs run on the CPU (interpreter) in this process."""
    assert TritonAttentionBackend.unavailable_reason(torch.device("cpu"), BLOCK) is not None
    TritonAttentionBackend.unavailable_reason = classmethod(lambda cls, device, bs: None)
    DecodeGraphs.supported = staticmethod(lambda device, name: None)

    def no_capture(self: DecodeGraphs) -> None:
        self.capture = False  # run() then takes the padded static buffers eagerly

    DecodeGraphs.capture_all = no_capture
    choose = triton_kernel.choose_num_splits

    def recorded(*args) -> int:
        SPLITS.append(choose(*args))
        return SPLITS[-1]

    triton_kernel.choose_num_splits = recorded


def runners(model_dir: str, num_blocks: int, graph_batch: int = 0):
    ref = ModelRunner(
        model_dir, dtype=DTYPE, block_size=BLOCK, num_blocks=num_blocks, attn_backend="torch"
    )
    tri = ModelRunner(
        model_dir,
        dtype=DTYPE,
        block_size=BLOCK,
        num_blocks=num_blocks,
        attn_backend="triton",
        cuda_graph_max_batch=graph_batch,
    )
    assert tri.backend.name == "triton" and ref.backend.name == "torch"
    return ref, tri


def step(ref: ModelRunner, tri: ModelRunner, chunks: list[SeqChunk], what: str) -> torch.Tensor:
    expected = ref.execute(ref.build_input(chunks))
    got = tri.execute(tri.build_input(chunks))
    err = (got - expected).abs().max().item()
    assert err < TOL[DTYPE], (what, err)
    return expected


def check_runner(model_dir: str) -> None:
    """Prefill (one prompt long enough for split-K), a mixed step (a chunk on a cached prefix
    next to decodes), then decodes whose contexts cross block boundaries."""
    ref, tri = runners(model_dir, num_blocks=40)
    blocks = BlockHandout(ref.num_blocks, seed=3)
    prompts = {"a": 5, "b": 30, "c": 40, "d": 140}
    decodes = 4
    tables = {s: blocks.table(n + decodes + 1, BLOCK) for s, n in prompts.items()}
    toks = {s: [(7 * i + len(s)) % 500 + 3 for i in range(n)] for s, n in prompts.items()}
    # Step 1: a, b, d whole; c's first 20 tokens (a chunk that wants no logits).
    first = [
        SeqChunk(toks["a"], 0, tables["a"], "all"),
        SeqChunk(toks["b"], 0, tables["b"], "last"),
        SeqChunk(toks["c"][:20], 0, tables["c"], "none"),
        SeqChunk(toks["d"], 0, tables["d"], "last"),
    ]
    logits = step(ref, tri, first, "prefill")
    nxt = {"a": logits[4].argmax().item(), "b": logits[5].argmax().item()}
    nxt["d"] = logits[6].argmax().item()
    lens = {"a": 5, "b": 30, "d": 140}
    # Step 2: c's second chunk on its cached prefix, mixed with three decodes.
    mixed = [SeqChunk([nxt[s]], lens[s], tables[s]) for s in ("a", "b", "d")]
    mixed.insert(1, SeqChunk(toks["c"][20:], 20, tables["c"], "all"))
    logits = step(ref, tri, mixed, "mixed")
    nxt = {"a": logits[0], "c": logits[20], "b": logits[21], "d": logits[22]}
    nxt = {s: t.argmax().item() for s, t in nxt.items()}
    lens = {"a": 6, "c": 40, "b": 31, "d": 141}
    for i in range(decodes - 1):  # b moves into its third block (position 32)
        order = ("d", "a", "c", "b")
        chunks = [SeqChunk([nxt[s]], lens[s], tables[s]) for s in order]
        logits = step(ref, tri, chunks, f"decode {i}")
        nxt = {s: logits[j].argmax().item() for j, s in enumerate(order)}
        lens = {s: n + 1 for s, n in lens.items()}
    assert max(SPLITS) > 1, SPLITS  # d's 140-token context is split


def check_graphs(model_dir: str) -> None:
    """Decode batches padded to a bucket (3 -> 4, 5 -> 8) through the runner's graphs: real
    rows equal the eager torch logits, and only the new tokens' slots and the pad block (index
    ``num_blocks`` of a cache of ``num_blocks + 1``) change in the KV cache."""
    ref, tri = runners(model_dir, num_blocks=24, graph_batch=8)
    graphs = tri.graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4, 8)
    pad = tri.num_blocks
    assert graphs.pad_block == pad and tri.kv_caches[0][0].shape[0] == pad + 1
    blocks = BlockHandout(ref.num_blocks, seed=1)
    for lengths in ([3, 17, 31], [1, 15, 16, 33, 64]):
        tables = [blocks.table(n + 2, BLOCK) for n in lengths]
        prompts = [
            SeqChunk([(5 * i + n) % 400 + 3 for i in range(n)], 0, t)
            for n, t in zip(lengths, tables, strict=True)
        ]
        logits = step(ref, tri, prompts, "prefill")  # prefill runs eagerly
        lens = list(lengths)
        for rep in range(2):  # the second step crosses 16 / 32 / 64 for some rows
            chunks = [
                SeqChunk([logits[i].argmax().item()], n, t)
                for i, (n, t) in enumerate(zip(lens, tables, strict=True))
            ]
            batch = tri.build_input(chunks)
            assert graphs.can_run(batch)
            before = [(k.clone(), v.clone()) for k, v in tri.kv_caches]
            replays = graphs.replays
            SPLITS.clear()
            logits = step(ref, tri, chunks, f"graph decode {lengths} {rep}")
            assert graphs.replays == replays + 1
            # Fixed by the graphs' max_seq_len (2048 tokens), not by the real contexts.
            assert set(SPLITS) == {triton_kernel.MAX_SPLITS}, SPLITS
            touched = torch.zeros(pad * BLOCK, dtype=torch.bool)
            touched[batch.slot_mapping] = True
            for (k, v), (k0, v0), (rk, rv) in zip(
                tri.kv_caches, before, ref.kv_caches, strict=True
            ):
                for new, old, want in ((k, k0, rk), (v, v0, rv)):
                    real = new[:pad].flatten(0, 1)
                    same = (real == old[:pad].flatten(0, 1)).flatten(1).all(1)
                    assert bool(same[~touched].all()), "a pad row wrote into a real block"
                    err = (real[touched] - want.flatten(0, 1)[touched]).abs().max().item()
                    assert err < TOL[DTYPE], ("new K/V", err)
                    assert bool(new[pad].ne(0).any()), "the padded rows wrote no pad block"
            lens = [n + 1 for n in lens]


CHECKS = {"runner": check_runner, "graphs": check_graphs}


if __name__ == "__main__":
    name, model_dir = sys.argv[1], sys.argv[2]
    DTYPE = sys.argv[3] if len(sys.argv) > 3 else DTYPE
    patch_once_per_launch()
    allow_cpu()
    CHECKS[name](model_dir)
    print("ok")
