"""The FlashInfer backend (``worker/attention/flashinfer_backend.py``).

On the CPU: its page lists, and the whole backend against the dense reference through a
stand-in ``flashinfer`` module that computes what FlashInfer's documentation says its paged
prefill wrapper computes (``NHD`` pages, ``indptr``/``indices``/``last_page_len``, causal mask
aligned with the end of each context, ``window_left`` inclusive): the translation of the
KV manager's block tables into FlashInfer's format is what these check. On CUDA with
``flashinfer`` installed (``-m cuda``): the real library against the torch backend.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from tests.model.test_paged_attention import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    MIXED,
    assert_matches_torch_backend,
    dense_reference,
    make_backend,
    make_scenario,
)
from worker.attention import BackendUnavailableError, available_backends
from worker.attention.flashinfer_backend import FlashInferAttentionBackend, page_lists


def test_page_lists_name_each_sequences_blocks_in_order() -> None:
    block_size, max_blocks = 4, 5
    # context lengths 1, 4, 5, 17 (4 full pages + 1), new tokens 1, 4, 2, 17
    lists = page_lists((1, 4, 2, 17), (1, 4, 5, 17), block_size, max_blocks)
    assert lists.qo_indptr.tolist() == [0, 1, 5, 7, 24]
    assert lists.kv_indptr.tolist() == [0, 1, 2, 4, 9]
    assert lists.last_page_len.tolist() == [1, 4, 1, 1]
    table = torch.arange(4 * max_blocks).view(4, max_blocks) + 100  # entry = 100 + flat index
    pages = table.view(-1)[lists.table_index].tolist()
    assert pages == [100, 105, 110, 111, 115, 116, 117, 118, 119]
    assert all(t.dtype == torch.int32 for t in (lists.qo_indptr, lists.kv_indptr))
    with pytest.raises(AssertionError, match="block table shorter"):
        page_lists((1,), (21,), block_size, max_blocks)


class DocumentedPrefillWrapper:
    """What FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` documents, in float64."""

    plans: list[dict] = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.plan_args: dict | None = None

    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal, sm_scale, window_left,
        q_data_type, kv_data_type,
    ) -> None:  # fmt: skip
        for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert t.dtype == torch.int32
        assert len(paged_kv_indices) == int(paged_kv_indptr[-1])
        assert bool(((paged_kv_last_page_len >= 1) & (paged_kv_last_page_len <= page_size)).all())
        self.plan_args = dict(locals())
        DocumentedPrefillWrapper.plans.append(self.plan_args)

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a = self.plan_args
        assert a is not None and q.dtype == a["q_data_type"]
        k_cache, v_cache = kv
        group = a["num_qo_heads"] // a["num_kv_heads"]
        qo, kvp = a["qo_indptr"].tolist(), a["paged_kv_indptr"].tolist()
        out = torch.empty_like(q)
        for i in range(len(qo) - 1):
            pages = a["paged_kv_indices"][kvp[i] : kvp[i + 1]].long()
            kv_len = (len(pages) - 1) * a["page_size"] + int(a["paged_kv_last_page_len"][i])
            keys = k_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, 1)
            vals = v_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, 1)
            rows = q[qo[i] : qo[i + 1]].double()
            q_pos = torch.arange(kv_len - len(rows), kv_len)[:, None]  # aligned to the end
            k_pos = torch.arange(kv_len)[None, :]
            visible = k_pos <= q_pos if a["causal"] else torch.ones_like(k_pos <= q_pos)
            if a["window_left"] >= 0:
                visible &= k_pos >= q_pos - a["window_left"]
            scores = torch.einsum("nhd,lhd->hnl", rows, keys) * a["sm_scale"]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[qo[i] : qo[i + 1]] = torch.einsum("hnl,lhd->nhd", probs, vals).to(q.dtype)
        return out


@pytest.fixture
def documented_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = DocumentedPrefillWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    DocumentedPrefillWrapper.plans = []
    return DocumentedPrefillWrapper


def cpu_backend() -> FlashInferAttentionBackend:
    """The backend on the CPU (its availability check wants CUDA: built directly)."""
    return FlashInferAttentionBackend(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 6])
def test_backend_matches_dense_reference_through_flashinfers_documented_contract(
    documented_flashinfer, block_size, window
) -> None:
    sc = make_scenario(MIXED, block_size, shared_prefix_blocks=1, seed=3, dtype=torch.float16)
    backend = cpu_backend()
    step = backend.prepare(sc.meta_input.attention_metadata())
    got = backend.forward(sc.q, sc.k, sc.v, sc.k_cache, sc.v_cache, step, window)
    torch.testing.assert_close(got.double(), dense_reference(sc, window), atol=1e-2, rtol=0)
    # a second layer of the step reuses the plan; another window plans its own wrapper
    backend.forward(sc.q, sc.k, sc.v, sc.k_cache, sc.v_cache, step, window)
    assert len(documented_flashinfer.plans) == 1
    backend.forward(sc.q, sc.k, sc.v, sc.k_cache, sc.v_cache, step, 3)
    assert [p["window_left"] for p in documented_flashinfer.plans] == [
        -1 if window is None else window - 1,
        2,
    ]


def test_backend_refuses_float32_caches_by_name(documented_flashinfer) -> None:
    sc = make_scenario(MIXED, 4, seed=1)
    backend = cpu_backend()
    step = backend.prepare(sc.meta_input.attention_metadata())
    with pytest.raises(ValueError, match="float16 or bfloat16 KV caches, got torch.float32"):
        backend.forward(sc.q, sc.k, sc.v, sc.k_cache, sc.v_cache, step)


def test_backend_is_unavailable_without_cuda() -> None:
    assert "flashinfer" not in available_backends("cpu")
    with pytest.raises(BackendUnavailableError, match="flashinfer.*needs a CUDA device"):
        make_backend("flashinfer", "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_matches_torch_backend_on_cuda(monkeypatch, block_size, window, dtype) -> None:
    import tests.model.test_paged_attention as scenarios

    monkeypatch.setattr(scenarios, "HEAD_DIM", 64)  # a head size FlashInfer's kernels build
    sc = make_scenario(
        MIXED, block_size, shared_prefix_blocks=1, seed=2, dtype=dtype, device="cuda"
    )
    assert_matches_torch_backend("flashinfer", sc, window, 2e-2)
