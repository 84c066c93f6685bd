"""The fused cascade kernels: one launch whose programs are the shared-prefix tiles (all of a
group's query heads packed into the rows of one tile per KV head) then the own-tail tiles, each
writing a partial state (out, lse) into one split buffer, and the merge kernel that joins them by
log-sum-exp. Launched by cascade_fused.py; no host sync inside."""

from __future__ import annotations

from ._triton import tl, triton
from .cascade_attend import _attend_store


@triton.jit
def _shared_tile(
    t,
    Q,
    K,
    V,
    ReqToToken,
    ReqIdx,
    GroupPtr,
    GroupShared,
    SharedGroups,
    MidO,
    MidLse,
    qk_scale,
    s_div,
    m_blocks,
    num_kv_heads,
    num_q_heads,
    split_stride,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Shared tile t: BLOCK_M rows (member * GROUP + head) of one group and KV head against one
    of s_div splits of the group's shared prefix (m-block fastest, so the tiles reading one
    K/V chunk run side by side and share it through L2)."""
    mb = t % m_blocks
    kvh = (t // m_blocks) % num_kv_heads
    split = (t // (m_blocks * num_kv_heads)) % s_div
    g = tl.load(SharedGroups + t // (m_blocks * num_kv_heads * s_div))
    r0 = tl.load(GroupPtr + g)
    n_rows = (tl.load(GroupPtr + g + 1) - r0).to(tl.int32) * GROUP
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_r = rows < n_rows
    reqs = r0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    shared = tl.where(mb * BLOCK_M < n_rows, tl.load(GroupShared + g).to(tl.int32), 0)
    per_split = tl.cdiv(tl.cdiv(shared, s_div), BLOCK_N) * BLOCK_N
    lo = split * per_split
    q = tl.load(
        Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    )
    _attend_store(
        q,
        ReqToToken + tl.load(ReqIdx + r0) * stride_rr,
        K,
        V,
        kvh,
        lo,
        tl.minimum(lo + per_split, shared),
        qk_scale,
        offs_d,
        mask_d,
        (reqs * num_q_heads + heads) * split_stride + split,
        mask_r,
        MidO,
        MidLse,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        BLOCK_M,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        DOT_PREC,
    )


@triton.jit
def _own_tile(
    t,
    Q,
    K,
    V,
    ReqToToken,
    ReqIdx,
    SeqLens,
    KvStart,
    MidO,
    MidLse,
    qk_scale,
    s_sh,
    s_own,
    num_kv_heads,
    num_q_heads,
    split_stride,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Own tile t: one request's GROUP heads of one KV head against one of s_own splits of its
    own tail (kv_start..seq_len-1); written at split index s_sh + split."""
    split = t % s_own
    kvh = (t // s_own) % num_kv_heads
    b = t // (s_own * num_kv_heads)
    local_h = tl.arange(0, BLOCK_H)
    mask_h = local_h < GROUP
    heads = kvh * GROUP + local_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = tl.load(KvStart + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, s_own), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    _attend_store(
        q,
        ReqToToken + tl.load(ReqIdx + b) * stride_rr,
        K,
        V,
        kvh,
        lo,
        tl.minimum(lo + per_split, seq_len),
        qk_scale,
        offs_d,
        mask_d,
        (b * num_q_heads + heads) * split_stride + s_sh + split,
        mask_h,
        MidO,
        MidLse,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        BLOCK_H,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        DOT_PREC,
    )


@triton.jit(
    do_not_specialize=["n_shared_tiles", "n_own_tiles", "s_div", "s_sh", "s_own", "m_blocks", "split_stride"]
)
def _cascade_fused_kernel(
    Q,
    K,
    V,
    ReqToToken,
    ReqIdx,
    SeqLens,
    KvStart,
    GroupPtr,
    GroupShared,
    SharedGroups,
    MidO,
    MidLse,
    qk_scale,
    n_shared_tiles,
    n_own_tiles,
    s_div,
    s_sh,
    s_own,
    m_blocks,
    num_kv_heads,
    num_q_heads,
    split_stride,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    OWN_BLOCK_N: tl.constexpr,
    SHARED_FIRST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Programs [0, n_shared_tiles) are shared-prefix tiles, the rest own-tail tiles (swapped
    when not SHARED_FIRST). Splits 0..s_sh-1 of the buffer hold the shared part, s_sh.. the own
    part; s_div = max(s_sh, 1) (s_sh is 0 when no group shares anything: no shared tile runs)."""
    pid = tl.program_id(0)
    if SHARED_FIRST:
        is_shared = pid < n_shared_tiles
        t = tl.where(is_shared, pid, pid - n_shared_tiles)
    else:
        is_shared = pid >= n_own_tiles
        t = tl.where(is_shared, pid - n_own_tiles, pid)
    if is_shared:
        _shared_tile(
            t,
            Q,
            K,
            V,
            ReqToToken,
            ReqIdx,
            GroupPtr,
            GroupShared,
            SharedGroups,
            MidO,
            MidLse,
            qk_scale,
            s_div,
            m_blocks,
            num_kv_heads,
            num_q_heads,
            split_stride,
            stride_qb,
            stride_qh,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            stride_rr,
            GROUP,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_M,
            BLOCK_N,
            DOT_PREC,
        )
    else:
        _own_tile(
            t,
            Q,
            K,
            V,
            ReqToToken,
            ReqIdx,
            SeqLens,
            KvStart,
            MidO,
            MidLse,
            qk_scale,
            s_sh,
            s_own,
            num_kv_heads,
            num_q_heads,
            split_stride,
            stride_qb,
            stride_qh,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            stride_rr,
            GROUP,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_H,
            OWN_BLOCK_N,
            DOT_PREC,
        )


@triton.jit(do_not_specialize=["num_splits", "s_sh"])
def _cascade_merge_kernel(
    MidO,
    MidLse,
    SharedLens,
    Out,
    num_splits,
    s_sh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program per (request, head): softmax-weighted sum of its partial states; the shared
    splits (0..s_sh-1) only count for requests with a shared part (others never wrote them)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    first = tl.where(tl.load(SharedLens + b) > 0, 0, s_sh)
    mask_s = (offs_s < num_splits) & (offs_s >= first)
    mask_d = offs_d < HEAD_DIM
    base = (b * tl.num_programs(1) + h) * num_splits
    lse = tl.load(MidLse + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w, 0)
    o = tl.load(
        MidO + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)
