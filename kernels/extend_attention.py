"""Paged extend (prefill) attention over a ragged batch: each request's new tokens attend to
its cached prefix (read through req_to_token, page size 1) and causally to themselves (read
from the new K/V, contiguous). Cached and new K/V may be fp8 (an fp8 pool, k_scale / v_scale
per KV head, one scale for both parts): rows are converted to q's dtype as loaded, the K scale is
folded into q and the V scale into the output. Promises: `extend_attention` equals
`extend_attention_ref` for any mix of prefix and extend lengths (zeros included), GQA included,
with no padding."""

from __future__ import annotations

import math

import torch

from ._attn_common import finish_state, online_update
from ._triton import dot_precision, mma, next_pow2, tl, triton, use_triton
from .kv_quant import apply_v_scale, dequantize_kv, fold_k_scale


@triton.jit
def _load_rows(ptrs, mask_n, mask_d, MASK_N: tl.constexpr, EVEN_D: tl.constexpr):
    """K or V rows as stored; callers widen an fp8 pool's rows to q's dtype (a no-op otherwise)."""
    if MASK_N:
        return tl.load(ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask_d[None, :], other=0.0)


@triton.jit
def _prefix_step(
    q,
    m_i,
    l_i,
    acc,
    row_ptr,
    Kbuf,
    Vbuf,
    kvh,
    stride_bt,
    stride_bh,
    stride_ct,
    stride_ch,
    n0,
    hi,
    offs_d,
    mask_d,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One BLOCK_N block of cached keys gathered through req_to_token (masked only at the tail)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    if MASK_N:
        slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0)
    else:
        slots = tl.load(row_ptr + offs_n)
    k = _load_rows(
        Kbuf + slots[:, None] * stride_bt + kvh * stride_bh + offs_d[None, :], mask_n, mask_d, MASK_N, EVEN_D
    ).to(q.dtype)
    qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
    if MASK_N:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
    v = _load_rows(
        Vbuf + slots[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :], mask_n, mask_d, MASK_N, EVEN_D
    ).to(q.dtype)
    return online_update(qk, m_i, l_i, acc, v, DOT_PREC)


@triton.jit
def _extend_kernel(
    Q,
    Knew,
    Vnew,
    Out,
    Kbuf,
    Vbuf,
    ReqToToken,
    ReqIdx,
    PrefixLens,
    ExtendLens,
    ExtendStart,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_bh,
    stride_ct,
    stride_ch,
    stride_rr,
    GROUP: tl.constexpr,
    HPP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Rows of a program are (token, head) pairs: HPP query heads of one KV head per token
    (HPP = GROUP packs the whole GQA group, so each K/V tile feeds GROUP heads)."""
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal rows first
    hp = tl.program_id(1)
    b = tl.program_id(2)
    ext_len = tl.load(ExtendLens + b).to(tl.int32)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    first_tok = (mb * BLOCK_M) // HPP
    if first_tok >= ext_len:
        return
    last_tok = (mb * BLOCK_M + BLOCK_M - 1) // HPP
    toks = rows // HPP
    heads = hp * HPP + rows % HPP
    kvh = (hp * HPP) // GROUP
    prefix_len = tl.load(PrefixLens + b).to(tl.int32)
    tok0 = tl.load(ExtendStart + b)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = toks < ext_len
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (tok0 + toks[:, None]) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) the cached prefix, gathered slot by slot through the request's row of req_to_token
    row_ptr = ReqToToken + tl.load(ReqIdx + b) * stride_rr
    prefix_full = prefix_len // BLOCK_N * BLOCK_N
    for n0 in range(0, prefix_full, BLOCK_N):
        m_i, l_i, acc = _prefix_step(
            q,
            m_i,
            l_i,
            acc,
            row_ptr,
            Kbuf,
            Vbuf,
            kvh,
            stride_bt,
            stride_bh,
            stride_ct,
            stride_ch,
            n0,
            prefix_len,
            offs_d,
            mask_d,
            qk_scale,
            BLOCK_N,
            False,
            EVEN_D,
            DOT_PREC,
        )
    if prefix_full < prefix_len:
        m_i, l_i, acc = _prefix_step(
            q,
            m_i,
            l_i,
            acc,
            row_ptr,
            Kbuf,
            Vbuf,
            kvh,
            stride_bt,
            stride_bh,
            stride_ct,
            stride_ch,
            prefix_full,
            prefix_len,
            offs_d,
            mask_d,
            qk_scale,
            BLOCK_N,
            True,
            EVEN_D,
            DOT_PREC,
        )

    # 2) the new tokens, causally: blocks wholly below the diagonal skip the mask
    full_end = first_tok // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(
            Knew + (tok0 + offs_n[:, None]) * stride_kt + kvh * stride_kh + offs_d[None, :],
            offs_n < ext_len,
            mask_d,
            False,
            EVEN_D,
        ).to(q.dtype)
        qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
        v = _load_rows(
            Vnew + (tok0 + offs_n[:, None]) * stride_vt + kvh * stride_vh + offs_d[None, :],
            offs_n < ext_len,
            mask_d,
            False,
            EVEN_D,
        ).to(q.dtype)
        m_i, l_i, acc = online_update(qk, m_i, l_i, acc, v, DOT_PREC)
    diag_end = tl.minimum(last_tok + 1, ext_len)
    for n0 in range(full_end, diag_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ext_len
        k = _load_rows(
            Knew + (tok0 + offs_n[:, None]) * stride_kt + kvh * stride_kh + offs_d[None, :],
            mask_n,
            mask_d,
            True,
            EVEN_D,
        ).to(q.dtype)
        qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
        qk = tl.where(mask_n[None, :] & (offs_n[None, :] <= toks[:, None]), qk, float("-inf"))
        v = _load_rows(
            Vnew + (tok0 + offs_n[:, None]) * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask_n,
            mask_d,
            True,
            EVEN_D,
        ).to(q.dtype)
        m_i, l_i, acc = online_update(qk, m_i, l_i, acc, v, DOT_PREC)

    out, _ = finish_state(m_i, l_i, acc)
    tl.store(
        Out + (tok0 + toks[:, None]) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_config(max_extend_len: int) -> dict[str, int]:
    """Default tiles for Hq 32 / Hkv 8 / D 128 bf16, GQA packed: long causal extends run best on
    128x64 tiles with 8 warps; prefix-heavy batches of short extends on 128x32, 4 warps (figures:
    benchmarks/results/kernels_h200.json)."""
    if max_extend_len >= 2048:
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
    return {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3}


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pack_gqa: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k_new/v_new [T, Hkv, D] → out [T, Hq, D]. max_extend_len is a host int
    (>= every extend length) that sizes the grid. pack_gqa: a program's rows are the GQA group's
    query heads of block_m / group tokens (K/V read once per group), else one head's tokens.
    k_scale / v_scale [Hkv] fp32: cached and new K/V hold K / scale, V / scale; None = 1."""
    if not use_triton(q):
        o = extend_attention_ref(
            q,
            k_new,
            v_new,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            prefix_lens,
            extend_lens,
            extend_start_loc,
            sm_scale,
            k_scale,
            v_scale,
        )
        return out.copy_(o) if out is not None else o
    t, hq, d = q.shape
    hkv = k_new.shape[1]
    if hq % hkv != 0 or k_buffer.shape[1] != hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv}) in new and cached K/V")
    if k_new.shape[0] != t or k_buffer.shape[2] != d:
        raise ValueError("q, k_new and the KV buffer disagree on token count or head dim")
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = out if out is not None else torch.empty_like(q)
    bsz = int(extend_lens.shape[0])
    if bsz == 0 or max_extend_len <= 0:
        return out
    cfg = extend_config(max_extend_len)
    block_m, block_n = block_m or cfg["block_m"], block_n or cfg["block_n"]
    num_warps, num_stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    hpp = hq // hkv if pack_gqa else 1
    grid = (triton.cdiv(max_extend_len * hpp, block_m), hq // hpp, bsz)
    q = fold_k_scale(q, k_scale)
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_start_loc,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=hq // hkv,
        HPP=hpp,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(d),
        EVEN_D=next_pow2(d) == d,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        enable_fp_fusion=True,
    )
    return apply_v_scale(out, v_scale)


def extend_attention_ref(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time: keys = prefix slots then the new tokens, causal mask;
    fp32 math (float64 for a float64 q); K/V dequantized with k_scale / v_scale (None = 1)."""
    t, hq, d = q.shape
    group = hq // k_new.shape[1]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros_like(q)
    for b in range(int(extend_lens.shape[0])):
        p, e, s0 = int(prefix_lens[b]), int(extend_lens[b]), int(extend_start_loc[b])
        if e == 0:
            continue
        slots = req_to_token[int(req_pool_indices[b]), :p]
        md = torch.float64 if q.dtype == torch.float64 else torch.float32
        k = torch.cat(
            [dequantize_kv(k_buffer[slots], k_scale, md), dequantize_kv(k_new[s0 : s0 + e], k_scale, md)]
        )
        v = torch.cat(
            [dequantize_kv(v_buffer[slots], v_scale, md), dequantize_kv(v_new[s0 : s0 + e], v_scale, md)]
        )
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[s0 : s0 + e].to(md), k) * sm_scale
        causal = (
            torch.arange(p + e, device=q.device)[None, :] <= (p + torch.arange(e, device=q.device))[:, None]
        )
        s = s.masked_fill(~causal, float("-inf"))
        out[s0 : s0 + e] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out
