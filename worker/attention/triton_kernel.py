"""Triton paged-attention kernel (imported only when the ``triton`` backend is created).

One program handles one sequence, one KV head and a tile of ``BLOCK_M`` query rows, where a
row is (new token, query head of that KV head's group): GQA heads that share K/V are packed
into the M dimension, so a decode step of a GQA model still fills a tensor-core tile. The
program walks the sequence's block table page by page (one page = one KV block) with an
online softmax, masking causally (bottom-right aligned: new tokens are the last ``q_len``
positions of the context) and, if set, outside the sliding window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_WINDOW = 1 << 30  # "window" that never masks anything


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, window,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_bt_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    rows_total = q_len * GROUP
    row0 = tile * BLOCK_M
    if row0 < rows_total:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < rows_total
        tok = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        q_pos = seq_len - q_len + tok  # absolute position of each query row
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        io_mask = row_ok[:, None] & d_ok[None, :]
        q_rows = (q_start + tok).to(tl.int64)
        q_offs = q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)

        last_tok = (tl.minimum(row0 + BLOCK_M, rows_total) - 1) // GROUP
        kv_end = seq_len - q_len + last_tok + 1  # one past the last position any row sees
        kv_begin = tl.maximum(seq_len - q_len + row0 // GROUP - window + 1, 0)
        offs_n = tl.arange(0, PAGE)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for page in range(kv_begin // PAGE, tl.cdiv(kv_end, PAGE)):
            block = tl.load(block_tables_ptr + seq * stride_bt_seq + page).to(tl.int64)
            k = tl.load(
                k_cache_ptr
                + block * stride_k_block
                + offs_n[:, None] * stride_k_slot
                + kv_head * stride_k_head
                + offs_d[None, :],
                mask=d_ok[None, :],
                other=0.0,
            )
            v = tl.load(
                v_cache_ptr
                + block * stride_v_block
                + offs_n[:, None] * stride_v_slot
                + kv_head * stride_v_head
                + offs_d[None, :],
                mask=d_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            k_pos = page * PAGE + offs_n
            visible = (k_pos[None, :] <= q_pos[:, None]) & (
                k_pos[None, :] > q_pos[:, None] - window
            )
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention of ``q`` [tokens, heads, d] over the paged cache; K/V already written."""
    tokens, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    block_m = 16 if max_query_len * group <= 16 else 64
    grid = (seq_lens.shape[0], num_kv_heads, triton.cdiv(max_query_len * group, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        scale, sliding_window or NO_WINDOW,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        PAGE=page,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
