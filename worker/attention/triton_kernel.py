"""Triton paged-attention kernel (imported only when the ``triton`` backend is created).

One program handles one sequence, one KV head and a tile of ``BLOCK_M`` query rows, where a
row is (new token, query head of that KV head's group): GQA heads that share K/V are packed
into the M dimension, so a decode step of a GQA model still fills a tensor-core tile. The
program walks the sequence's block table page by page (one page = one KV block) with an
online softmax, masking causally (bottom-right aligned: new tokens are the last ``q_len``
positions of the context) and, if set, outside the sliding window.

Split-K (flash-decoding): when the grid above has too few programs to fill the GPU (small
decode batches over long contexts), each program's page range is cut into ``num_splits``
parts walked by separate programs; each writes its normalised partial output and the
log-sum-exp of its scores, and a second kernel merges the parts with softmax weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_WINDOW = 1 << 30  # "window" that never masks anything
MAX_SPLITS = 16
MIN_PAGES_PER_SPLIT = 4  # below this a split's fixed cost outweighs the parallelism it adds
TARGET_PROGRAMS = 4 * 132  # a few waves of an H100/H200-class GPU's SMs


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    window,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_seq,
    stride_po_split,
    stride_po_tok,
    stride_po_head,
    stride_pl_split,
    stride_pl_tok,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

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
        first_page = kv_begin // PAGE
        end_page = tl.cdiv(kv_end, PAGE)
        per_split = tl.cdiv(end_page - first_page, NUM_SPLITS)
        split_begin = first_page + split * per_split
        split_end = tl.minimum(split_begin + per_split, end_page)
        for page in range(split_begin, split_end):
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
        if NUM_SPLITS == 1:
            o_offs = (
                q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
            )
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            # An empty split (l == 0) gets lse = -inf, so the merge gives it zero weight.
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_i))
            p_offs = (
                split * stride_po_split
                + q_rows[:, None] * stride_po_tok
                + head[:, None] * stride_po_head
                + offs_d[None, :]
            )
            tl.store(part_out_ptr + p_offs, out, mask=io_mask)
            l_offs = split * stride_pl_split + q_rows * stride_pl_tok + head
            tl.store(part_lse_ptr + l_offs, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_po_split,
    stride_po_tok,
    stride_po_head,
    stride_pl_split,
    stride_pl_tok,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(
        part_lse_ptr + offs_s * stride_pl_split + tok * stride_pl_tok + head,
        mask=s_ok,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    parts = tl.load(
        part_out_ptr
        + offs_s[:, None] * stride_po_split
        + tok * stride_po_tok
        + head * stride_po_head
        + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, tiles: int, max_seq_len: int, page: int
) -> int:
    """Splits of each program's context so the grid reaches ``TARGET_PROGRAMS``, keeping at
    least ``MIN_PAGES_PER_SPLIT`` pages per split; 1 when the grid is already large."""
    programs = max(1, num_seqs * num_kv_heads * tiles)
    if programs >= TARGET_PROGRAMS:
        return 1
    by_grid = triton.cdiv(TARGET_PROGRAMS, programs)
    by_len = max(1, triton.cdiv(max_seq_len, page) // MIN_PAGES_PER_SPLIT)
    return max(1, min(MAX_SPLITS, by_grid, by_len))


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
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [tokens, heads, d] over the paged cache; K/V already written.

    ``num_splits`` (split-K) defaults to ``choose_num_splits`` when ``max_seq_len`` (a host
    value, so no device sync) is given, else 1."""
    tokens, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(1) == 1  # the kernel steps through a table row by 1
    out = torch.empty_like(q)
    block_m = 16 if max_query_len * group <= 16 else 64
    num_seqs = seq_lens.shape[0]
    tiles = triton.cdiv(max_query_len * group, block_m)
    if num_splits is None:
        num_splits = (
            1
            if max_seq_len is None
            else choose_num_splits(num_seqs, num_kv_heads, tiles, max_seq_len, page)
        )
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(
            (num_splits, tokens, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = part_out.new_empty((num_splits, tokens, num_heads))
    else:  # unused by the kernel; any tensor satisfies the signature
        part_out, part_lse = out, out
    grid = (num_seqs, num_kv_heads, tiles * num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        part_out,
        part_lse,
        scale,
        sliding_window or NO_WINDOW,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        NUM_SPLITS=num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        PAGE=page,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if num_splits > 1:
        _merge_splits_kernel[(tokens, num_heads)](
            part_out,
            part_lse,
            out,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
        )
    return out
