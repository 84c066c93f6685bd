"""Rotary position embedding, HF rotate-half (neox) style, from a cos/sin cache indexed by
position: x' = x * cos + rotate_half(x) * sin, for q and k in one launch; for decode the same
launch can write the rotated k and the raw v straight into the KV pool (`rotary_and_store`,
quantizing for an fp8 pool), saving the separate store kernel. Promises: equals `rotary_ref`
(fp32 math, one rounding) and HF's apply_rotary_pos_emb to rounding; the pool rows written equal
`kv_store_ref`'s applied to the rotated k (rounded to k's dtype) and v."""

from __future__ import annotations

import torch

from ._triton import next_pow2, pdl_args, pdl_wait, tl, triton, use_triton
from .kv_quant import is_fp8
from .kv_store import kv_store_ref, quantize_rows


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """[max_position, D] fp32: cos(pos * inv_freq) in the first half, sin in the second
    (inv_freq [D/2] already carries any rope scaling, e.g. Llama 3's)."""
    freqs = torch.outer(
        torch.arange(max_position, dtype=torch.float32, device=inv_freq.device), inv_freq.float()
    )
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# Heads per program: a token's 32 q and 8 k heads take five programs, whose loads run side by side
# where one program would take them block after block
HEADS_PER_PROGRAM = 8


@triton.jit
def _rotate_heads(
    X,
    Y,
    tok,
    out_row,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    h0,
    n_heads,
    cos,
    sin,
    Scale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Heads h0 .. h0 + BLOCK_H - 1 (those below n_heads). QUANT: Y is an fp8 pool buffer; the
    rotated rows (rounded to X's dtype first, as the unfused rope-then-store path would hold
    them) are quantized with Scale[head]."""
    hh = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (hh[:, None] < n_heads) & (offs_d[None, :] < HALF)
    src = X + tok * stride_xt + hh[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Y + out_row * stride_yt + hh[:, None] * stride_yh + offs_d[None, :]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if QUANT:
        s = tl.load(Scale + hh, mask=hh < n_heads, other=1.0)[:, None]
        y1 = quantize_rows(y1.to(X.dtype.element_ty), s, True, Y)
        y2 = quantize_rows(y2.to(X.dtype.element_ty), s, True, Y)
    tl.store(dst, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _copy_v_row(
    V,
    Vbuf,
    tok,
    slot,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_bh,
    h0,
    n_heads,
    Scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Heads h0 .. h0 + BLOCK_H - 1 of v's row tok into the pool row slot."""
    hh = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (hh[:, None] < n_heads) & (offs_d[None, :] < HEAD_DIM)
    v = tl.load(V + tok * stride_vt + hh[:, None] * stride_vh + offs_d[None, :], mask=mask)
    s = 1.0
    if QUANT:
        s = tl.load(Scale + hh, mask=hh < n_heads, other=1.0)[:, None]
    tl.store(
        Vbuf + slot * stride_bt + hh[:, None] * stride_bh + offs_d[None, :],
        quantize_rows(v, s, QUANT, Vbuf),
        mask=mask,
    )


@triton.jit
def _rotary_kernel(
    Q,
    K,
    Qo,
    Ko,
    Pos,
    Cache,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_c,
    n_q_heads,
    n_k_heads,
    V,
    Vbuf,
    Loc,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_bh,
    KScale,
    VScale,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (token, block of BLOCK_H heads): q's blocks first, then k's (with v's
    same heads when storing), so one token's heads spread over several programs.
    STORE_KV: Ko is the pool's K buffer and k's output row is Loc[tok]; v is copied to Vbuf.
    QUANT: the pool is fp8, quantized with KScale / VScale per KV head."""
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    pos = tl.load(Pos + tok)
    offs_d = tl.arange(0, BLOCK_HALF)
    cmask = offs_d < HALF
    cos = tl.load(Cache + pos * stride_c + offs_d, mask=cmask, other=0.0)[None, :]
    sin = tl.load(Cache + pos * stride_c + HALF + offs_d, mask=cmask, other=0.0)[None, :]
    if part < q_blocks:
        _rotate_heads(
            Q,
            Qo,
            tok,
            tok,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            part * BLOCK_H,
            n_q_heads,
            cos,
            sin,
            KScale,
            HALF,
            BLOCK_H,
            BLOCK_HALF,
            False,
        )
    else:
        h0 = (part - q_blocks) * BLOCK_H
        k_row = tok
        if STORE_KV:
            k_row = tl.load(Loc + tok).to(tl.int64)
            _copy_v_row(
                V,
                Vbuf,
                tok,
                k_row,
                stride_vt,
                stride_vh,
                stride_bt,
                stride_bh,
                h0,
                n_k_heads,
                VScale,
                2 * HALF,
                BLOCK_H,
                2 * BLOCK_HALF,
                QUANT,
            )
        _rotate_heads(
            K,
            Ko,
            tok,
            k_row,
            stride_kt,
            stride_kh,
            stride_pt,
            stride_ph,
            h0,
            n_k_heads,
            cos,
            sin,
            KScale,
            HALF,
            BLOCK_H,
            BLOCK_HALF,
            QUANT,
        )


def _check(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rotary wants q [T, Hq, D], k [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    d = q.shape[2]
    if d % 2 or cos_sin_cache.shape[-1] != d:
        raise ValueError(f"cos/sin cache width {cos_sin_cache.shape[-1]} must equal the even head dim {d}")


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    qo: torch.Tensor,
    ko: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """scales: (K, V) per-KV-head scales when storing into an fp8 pool."""
    if q.stride(2) != 1 or k.stride(2) != 1:
        q, k = q.contiguous(), k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    v, v_buf, loc = store if store is not None else (k, ko, positions)  # unused when not storing
    k_scale, v_scale = scales if scales is not None else (cache, cache)  # unused unless QUANT
    if q.shape[0]:
        half = q.shape[2] // 2
        block_h = min(HEADS_PER_PROGRAM, next_pow2(max(q.shape[1], k.shape[1])))
        parts = triton.cdiv(q.shape[1], block_h) + triton.cdiv(k.shape[1], block_h)
        _rotary_kernel[(q.shape[0], parts)](
            q,
            k,
            qo,
            ko,
            positions,
            cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            qo.stride(0),
            qo.stride(1),
            ko.stride(0),
            ko.stride(1),
            cache.stride(0),
            q.shape[1],
            k.shape[1],
            v,
            v_buf,
            loc,
            v.stride(0),
            v.stride(1),
            v_buf.stride(0),
            v_buf.stride(1),
            k_scale,
            v_scale,
            HALF=half,
            BLOCK_H=block_h,
            BLOCK_HALF=next_pow2(half),
            STORE_KV=store is not None,
            QUANT=scales is not None,
            num_warps=4,
            **pdl_args(q, "rotary"),
            enable_fp_fusion=True,
        )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (last dim contiguous), positions [T] → rotated (q, k), new tensors."""
    _check(q, k, cos_sin_cache)
    if not use_triton(q):
        return rotary_ref(q, k, positions, cos_sin_cache)
    qo, ko = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    _launch(q, k, qo, ko, positions, cos_sin_cache, None)
    return qo, ko


def rotary_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k; write rotated k into k_buffer[loc] and v into v_buffer[loc] (buffers
    [S, Hkv, D], last dim contiguous; fp8 buffers quantized with k_scale / v_scale [Hkv] fp32,
    None = all 1); return rotated q. One launch."""
    _check(q, k, cos_sin_cache)
    if k_buffer.shape[1:] != k.shape[1:] or v.shape != k.shape or v_buffer.stride() != k_buffer.stride():
        raise ValueError(f"pool rows {tuple(k_buffer.shape[1:])} must match k/v {tuple(k.shape[1:])}")
    if not use_triton(q):
        qr, kr = rotary_ref(q, k, positions, cos_sin_cache)
        kv_store_ref(k_buffer, v_buffer, loc, kr, v, k_scale, v_scale)
        return qr
    scales = None
    if is_fp8(k_buffer.dtype):
        ones = torch.ones(k_buffer.shape[1], dtype=torch.float32, device=k_buffer.device)
        scales = (k_scale if k_scale is not None else ones, v_scale if v_scale is not None else ones)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    v = v if v.stride(2) == 1 else v.contiguous()
    _launch(q, k, qo, k_buffer, positions, cos_sin_cache, (v, v_buffer, loc), scales)
    return qo


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions].float()
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], -1) * sin).to(x.dtype)

    return rot(q), rot(k)
