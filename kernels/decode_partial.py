"""Split-K paged decode attention's first stage (`decode_partial`): one program per (request,
block of a KV head's query heads, split of the keys) writes its partial (out, lse), or the output
itself when there is one split, or, given split counters, the last split to finish merges them
all (`merge_state.merge_if_last`). Promises: the states `decode_attention` merges into
`decode_attention_ref`'s output; no host sync."""

from __future__ import annotations

import torch

from ._attn_common import finish_state, online_update, widen_e4m3_f16
from ._triton import dot_precision, mma, next_pow2, pdl_args, pdl_wait, split_block, tl, triton
from .kv_quant import widen_f16, widen_v_in_registers
from .merge_state import merge_if_last


@triton.jit(do_not_specialize=["num_splits", "split_stride", "split_offset"])
def _decode_partial_kernel(
    Q,
    K,
    V,
    ReqToToken,
    ReqIdx,
    SeqLens,
    KvStart,
    MidO,
    MidLse,
    Out,
    OutLse,
    KScale,
    VScale,
    Counters,
    sm_scale,
    num_splits,
    num_q_heads,
    split_stride,
    split_offset,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_START: tl.constexpr,
    DOT_PREC: tl.constexpr,
    WIDEN_F16: tl.constexpr,
    V_IN_REGISTERS: tl.constexpr,
    DIRECT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    MERGE_LAST: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """MERGE_LAST (a head block per KV head, no split offset): the last split of each request and
    KV head to finish merges the states into Out (merge_state.merge_if_last)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    hb_per_kv = (GROUP + BLOCK_H - 1) // BLOCK_H
    kvh = hb // hb_per_kv
    local_h = (hb % hb_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = local_h < GROUP
    heads = kvh * GROUP + local_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = 0
    if HAS_START:
        start = tl.load(KvStart + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    row_ptr = ReqToToken + tl.load(ReqIdx + b) * stride_rr
    qk_scale = sm_scale * 1.4426950408889634
    if HAS_K_SCALE:  # q·(k8·s) == (q·k8)·s: one KV head per program, so one scalar
        qk_scale = qk_scale * tl.load(KScale + kvh)
    if WIDEN_F16:  # scores come out scaled; q shrinks by the softmax scale, far from float16's limit
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)  # an fp8 pool's rows, widened; a no-op for a pool in q's dtype
        qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        v = widen_e4m3_f16(v) if V_IN_REGISTERS else v.to(q.dtype)
        m_i, l_i, acc = online_update(qk, m_i, l_i, acc, v, DOT_PREC)

    out, lse = finish_state(m_i, l_i, acc)
    if HAS_V_SCALE:  # the softmax weights sum to one: scaling V's rows scales the output
        out = out * tl.load(VScale + kvh)
    mask_hd = mask_h[:, None] & mask_d[None, :]
    if DIRECT:  # one split: the state is the answer, stored where a merge would have put it
        out_at = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_at, out.to(Out.dtype.element_ty), mask=mask_hd)
        if WRITE_LSE:
            tl.store(OutLse + b * num_q_heads + heads, lse, mask=mask_h)
    else:
        base = (b * num_q_heads + heads) * split_stride + split_offset + split
        tl.store(MidO + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_hd)
        tl.store(MidLse + base, lse, mask=mask_h)
        if MERGE_LAST:
            counter = Counters + b * tl.num_programs(1) + hb
            merge_if_last(
                counter,
                MidO,
                MidLse,
                Out,
                OutLse,
                b,
                kvh,
                num_splits,
                num_q_heads,
                stride_ob,
                stride_oh,
                GROUP,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_S,
                WRITE_LSE,
            )


def decode_partial(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_start: torch.Tensor | None,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    split_offset: int,
    num_splits: int,
    sm_scale: float,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Stage 1 only: write num_splits partial states per (request, head) into mid_o [B, Hq, S, D]
    / mid_lse [B, Hq, S] at split indices split_offset.. (S may hold other partial states).
    With out [B, Hq, D] and num_splits 1 (no merge is needed): the final output goes there, in
    out's dtype, and the lse into out_lse [B, Hq] when given; mid_o / mid_lse are not written.
    With out and counters (`merges_inside`; S = num_splits, split_offset 0): the states are
    written and the last split to finish merges them into out / out_lse.
    k_scale / v_scale [Hkv] fp32 (an fp8 pool's): applied inside, to the scores and the states."""
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    group = hq // hkv
    block_h = max(16, min(64, next_pow2(group)))
    hb_per_kv = triton.cdiv(group, block_h)
    merge_last = counters is not None
    if merge_last and not (merges_inside(counters, bsz, hq, hkv) and out is not None):
        raise ValueError("merging inside takes out and counters for every (request, KV head)")
    if merge_last and (split_offset or mid_o.shape[2] != num_splits):
        raise ValueError(f"merging inside needs all {mid_o.shape[2]} splits from split 0")
    if out is not None and num_splits != 1 and not merge_last:
        raise ValueError(f"a direct output needs one split, not {num_splits}")
    direct = out if out is not None else mid_o
    _decode_partial_kernel[(bsz, hkv * hb_per_kv, num_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_start if kv_start is not None else seq_lens,
        mid_o,
        mid_lse,
        direct,
        out_lse if out_lse is not None else mid_lse,
        k_scale if k_scale is not None else mid_lse,
        v_scale if v_scale is not None else mid_lse,
        counters if counters is not None else mid_lse,
        sm_scale,
        num_splits,
        hq,
        1 if out is not None and not merge_last else mid_o.shape[2],
        split_offset,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        direct.stride(0),
        direct.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(d),
        HAS_START=kv_start is not None,
        DOT_PREC=dot_precision(q.dtype),
        WIDEN_F16=widen_f16(q, k_buffer),
        V_IN_REGISTERS=widen_v_in_registers(q, v_buffer),
        DIRECT=out is not None and not merge_last,
        WRITE_LSE=out_lse is not None,
        HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None,
        MERGE_LAST=merge_last,
        BLOCK_S=split_block(num_splits),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(q, "decode_partial"),
        enable_fp_fusion=True,
    )


def merges_inside(counters: torch.Tensor | None, bsz: int, hq: int, hkv: int) -> bool:
    """Whether counters let a launch merge its splits itself: int32, one per (request, KV head),
    and one program holding all of a KV head's query heads."""
    group = hq // hkv
    return (
        counters is not None
        and counters.dtype == torch.int32
        and counters.numel() >= bsz * hkv
        and group <= 64
    )
