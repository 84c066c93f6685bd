"""Cascade decode as two launches and a merge: a shared-prefix kernel over every group's prefix,
split-K decode over each request's own tail, then one merge of both into the output (or, without
fused_merge, each part finished separately and joined by merge_state). The fused one-launch impl
in cascade_attention.py is the default; this one is kept as its yardstick. K/V rows are widened
to q's dtype as loaded (an fp8 pool; the caller folds its scales)."""

from __future__ import annotations

import torch

from ._attn_common import finish_state, online_update
from ._triton import dot_precision, mma, next_pow2, tl, triton
from .cascade_plan import CascadePlan
from .decode_attention import decode_partial
from .decode_splits import choose_num_splits
from .merge_state import merge_splits, merge_state


@triton.jit
def _shared_prefix_kernel(
    Q,
    K,
    V,
    ReqToToken,
    ReqIdx,
    GroupPtr,
    GroupShared,
    MidO,
    MidLse,
    sm_scale,
    num_splits,
    num_m_blocks,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    g = tl.program_id(0)
    kvh = tl.program_id(1) // num_m_blocks
    mb = tl.program_id(1) % num_m_blocks
    split = tl.program_id(2)
    r0 = tl.load(GroupPtr + g)
    n_rows = (tl.load(GroupPtr + g + 1) - r0).to(tl.int32) * GROUP
    if mb * BLOCK_M >= n_rows:
        return
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # row = member * GROUP + head within the KV group
    mask_r = rows < n_rows
    reqs = r0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    shared = tl.load(GroupShared + g).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(shared, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, shared)

    q = tl.load(
        Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    )
    row_ptr = ReqToToken + tl.load(ReqIdx + r0) * stride_rr
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)
        qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)
        m_i, l_i, acc = online_update(qk, m_i, l_i, acc, v, DOT_PREC)

    out, lse = finish_state(m_i, l_i, acc)
    base = (reqs * num_q_heads + heads) * split_stride + split
    tl.store(MidO + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_r[:, None] & mask_d[None, :])
    tl.store(MidLse + base, lse, mask=mask_r)


def _shared_launch(
    q,
    k_buffer,
    v_buffer,
    req_to_token,
    req_pool_indices,
    plan,
    mid_o,
    mid_lse,
    num_splits,
    sm_scale,
    block_m,
    block_n,
    num_warps,
    num_stages,
) -> None:
    hq, d = q.shape[1], q.shape[2]
    hkv = k_buffer.shape[1]
    group = hq // hkv
    num_m_blocks = triton.cdiv(plan.max_group_size * group, block_m)
    grid = (plan.group_shared_lens.shape[0], hkv * num_m_blocks, num_splits)
    _shared_prefix_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        plan.group_ptr,
        plan.group_shared_lens,
        mid_o,
        mid_lse,
        sm_scale,
        num_splits,
        num_m_blocks,
        hq,
        mid_o.shape[2],
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(d),
        DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        enable_fp_fusion=True,
    )


def two_launch(
    q,
    k_buffer,
    v_buffer,
    req_to_token,
    req_pool_indices,
    seq_lens,
    plan: CascadePlan,
    sm_scale,
    fused_merge,
    shared_splits,
    own_splits,
    cfg,
    sms,
    out,
) -> torch.Tensor:
    """Shared-prefix kernel over every group, split-K decode for the own tails, then a merge."""
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    bm, bn, nw, ns = cfg["block_m"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"]
    n_groups = int(plan.group_shared_lens.shape[0])
    m_blocks = triton.cdiv(plan.max_group_size * (hq // hkv), bm)
    s_sh = shared_splits or choose_num_splits(n_groups * m_blocks, hkv, plan.max_shared_len, sms, bn, 512)
    s_own = own_splits or choose_num_splits(bsz, hkv, plan.max_own_len, sms, bn)
    if fused_merge:
        mid_o = torch.empty((bsz, hq, s_sh + s_own, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bsz, hq, s_sh + s_own), dtype=torch.float32, device=q.device)
        _shared_launch(
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            plan,
            mid_o,
            mid_lse,
            s_sh,
            sm_scale,
            bm,
            bn,
            nw,
            ns,
        )
        decode_partial(
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            plan.shared_lens,
            mid_o,
            mid_lse,
            s_sh,
            s_own,
            sm_scale,
            bn,
            nw,
            ns,
        )
        merge_splits(mid_o, mid_lse, out)
        return out
    states = []
    for s, shared in ((s_sh, True), (s_own, False)):
        mid_o = torch.empty((bsz, hq, s, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bsz, hq, s), dtype=torch.float32, device=q.device)
        if shared:
            _shared_launch(
                q,
                k_buffer,
                v_buffer,
                req_to_token,
                req_pool_indices,
                plan,
                mid_o,
                mid_lse,
                s,
                sm_scale,
                bm,
                bn,
                nw,
                ns,
            )
        else:
            decode_partial(
                q,
                k_buffer,
                v_buffer,
                req_to_token,
                req_pool_indices,
                seq_lens,
                plan.shared_lens,
                mid_o,
                mid_lse,
                0,
                s,
                sm_scale,
                bn,
                nw,
                ns,
            )
        o = torch.empty((bsz, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device)
        merge_splits(mid_o, mid_lse, o, lse)
        states.append((o, lse))
    return merge_state(states[0][0], states[0][1], states[1][0], states[1][1], out=out)
