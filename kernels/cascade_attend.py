"""The attention step of every cascade tile: attend a tile's query rows to one key range of one
request's KV row (whole blocks unmasked, then a masked tail) by online softmax, and store the
partial state (out, lse) in the split buffer for the merge. K/V rows are widened to q's dtype as
loaded (an fp8 pool; its scales are folded outside). Device functions only."""

from __future__ import annotations

from ._attn_common import finish_state, online_update
from ._triton import mma, tl, triton


@triton.jit
def _fold_block(
    q,
    m_i,
    l_i,
    acc,
    row_ptr,
    K,
    V,
    kvh,
    n0,
    hi,
    qk_scale,
    offs_d,
    mask_d,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Fold keys n0..n0+BLOCK_N-1 (only those < hi when MASKED) into the running state."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    if MASKED:
        slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        slots = tl.load(row_ptr + offs_n)
        kv_mask = mask_d[None, :]  # broadcast over the block's rows
    k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype)  # an fp8 pool's rows, widened; a no-op for a pool in q's dtype
    qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
    if MASKED:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
    v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    return online_update(qk, m_i, l_i, acc, v.to(q.dtype), DOT_PREC)


@triton.jit
def _attend_store(
    q,
    row_ptr,
    K,
    V,
    kvh,
    lo,
    hi,
    qk_scale,
    offs_d,
    mask_d,
    out_idx,
    mask_rows,
    MidO,
    MidLse,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Attend ROWS query rows q to keys lo..hi-1 of one request row (whole blocks unmasked, then a
    masked tail) and store the partial state (out, lse) at split-buffer indices out_idx."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    hi = tl.maximum(hi, lo)
    n_full = lo + (hi - lo) // BLOCK_N * BLOCK_N
    for n0 in range(lo, n_full, BLOCK_N):
        m_i, l_i, acc = _fold_block(
            q,
            m_i,
            l_i,
            acc,
            row_ptr,
            K,
            V,
            kvh,
            n0,
            hi,
            qk_scale,
            offs_d,
            mask_d,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            BLOCK_N,
            False,
            DOT_PREC,
        )
    if n_full < hi:
        m_i, l_i, acc = _fold_block(
            q,
            m_i,
            l_i,
            acc,
            row_ptr,
            K,
            V,
            kvh,
            n_full,
            hi,
            qk_scale,
            offs_d,
            mask_d,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            BLOCK_N,
            True,
            DOT_PREC,
        )
    out, lse = finish_state(m_i, l_i, acc)
    tl.store(
        MidO + out_idx[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_rows[:, None] & mask_d[None, :]
    )
    tl.store(MidLse + out_idx, lse, mask=mask_rows)
