"""Paged decode attention (one new token per request) over the KV pool, split-K flash-decoding
with GQA grouping: one program serves all query heads of a KV head, so each K/V row is read once
and QK^T / PV run on tensor cores; partial (out, lse) per KV split, then a merge kernel (with one
split the partial kernel writes the output itself). An fp8 pool is read as is, its rows widened to
float16 in the kernel (the dots then run in float16, q scaled into it; on CUDA, V is widened in
registers: kv_quant.widen_v_in_registers); its K and V scales, one per KV head, are applied
inside the kernel, to the scores and to the output.
Promises: `decode_attention` equals `decode_attention_ref` (softmax over each request's slots
kv_start..seq_len-1 read through req_to_token, page size 1, K/V dequantized) and never syncs
with the host."""

from __future__ import annotations

import math
from typing import Literal, overload

import torch

from ._attn_common import finish_state, online_update, widen_e4m3_f16
from ._triton import dot_precision, mma, next_pow2, pdl_args, pdl_wait, tl, triton, use_triton
from .decode_splits import choose_decode_splits, decode_block_n
from .kv_quant import dequantize_kv, widen_f16, widen_v_in_registers
from .merge_state import merge_splits as merge_splits  # re-exported: split-K decode's second stage


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
    PDL: tl.constexpr,
):
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


@overload
def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: Literal[False] = False,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    return_lse: Literal[True],
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] → out [B, Hq, D] (q's dtype); attends to positions kv_start[b]..seq_lens[b]-1.
    num_splits (or max_len, host-side, to pick it) fixes the grid: no device→host sync.
    k_scale / v_scale [Hkv] fp32: the buffers hold K / scale, V / scale (an fp8 pool); None = 1.
    The lse is of the dequantized scores, as the reference's. block_n None: decode_block_n."""
    if not use_triton(q):
        o, ref_lse = decode_attention_ref(
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            sm_scale,
            kv_start,
            k_scale,
            v_scale,
        )
        if out is not None:
            out.copy_(o)
            o = out
        return (o, ref_lse) if return_lse else o
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    _check_heads(hq, hkv, d, k_buffer)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    block_n = block_n or decode_block_n(k_buffer)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = choose_decode_splits(
            bsz, hkv, max_len if max_len is not None else 4096, sms, k_buffer.dtype
        )
    out = out if out is not None else torch.empty_like(q)
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device) if return_lse else None
    if bsz == 0:
        if return_lse:
            assert lse is not None
            return out, lse
        return out
    one = num_splits == 1  # the state needs no merge: the kernel writes out (and lse) itself
    mid_o = out if one else q.new_empty((bsz, hq, num_splits, d), dtype=torch.float32)
    mid_lse = lse if one and lse is not None else q.new_empty((bsz, hq, num_splits), dtype=torch.float32)
    decode_partial(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_start,
        mid_o,
        mid_lse,
        0,
        num_splits,
        sm_scale,
        block_n,
        num_warps,
        num_stages,
        out=out if one else None,
        out_lse=lse if one else None,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if not one:
        merge_splits(mid_o, mid_lse, out, lse)
    if return_lse:
        assert lse is not None
        return out, lse
    return out


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
) -> None:
    """Stage 1 only: write num_splits partial states per (request, head) into mid_o [B, Hq, S, D]
    / mid_lse [B, Hq, S] at split indices split_offset.. (S may hold other partial states).
    With out [B, Hq, D] (num_splits 1, so no merge is needed): the final output goes there, in
    out's dtype, and the lse into out_lse [B, Hq] when given; mid_o / mid_lse are not written.
    k_scale / v_scale [Hkv] fp32 (an fp8 pool's): applied inside, to the scores and the states."""
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    group = hq // hkv
    block_h = max(16, min(64, next_pow2(group)))
    hb_per_kv = triton.cdiv(group, block_h)
    if out is not None and num_splits != 1:
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
        sm_scale,
        num_splits,
        hq,
        1 if out is not None else mid_o.shape[2],
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
        DIRECT=out is not None,
        WRITE_LSE=out_lse is not None,
        HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_args(q, "decode_partial"),
        enable_fp_fusion=True,
    )


def _check_heads(hq: int, hkv: int, d: int, k_buffer: torch.Tensor) -> None:
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if k_buffer.shape[2] != d:
        raise ValueError(f"head dim mismatch: q has {d}, KV buffer has {k_buffer.shape[2]}")
    if k_buffer.stride(2) != 1:
        raise ValueError("KV buffer's last dimension must be contiguous")


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    kv_start: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, one request at a time, fp32 math (or q's, if float64) → (out [B, Hq, D] in q's
    dtype, lse [B, Hq]); K/V rows dequantized with k_scale / v_scale [Hkv] (None = 1)."""
    bsz, hq, d = q.shape
    group = hq // k_buffer.shape[1]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros_like(q)
    lse = torch.full((bsz, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(bsz):
        lo = int(kv_start[b]) if kv_start is not None else 0
        hi = int(seq_lens[b])
        if hi <= lo:
            continue
        slots = req_to_token[int(req_pool_indices[b]), lo:hi]
        math_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        k = dequantize_kv(k_buffer[slots], k_scale, math_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = dequantize_kv(v_buffer[slots], v_scale, math_dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].to(math_dtype), k) * sm_scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out, lse
