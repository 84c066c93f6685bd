"""KV store: write the step's new K and V ([T, Hkv, D]) into the pool's per-layer buffers at
slots loc ([T]) in one launch. Promises: equals `kv_store_ref` (buffer[loc] = value cast to the
buffer dtype; for an fp8 buffer, clamp(value / scale[head], ±448) as e4m3, exactly
kv_quant.quantize_kv); rows not in loc are untouched."""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, interpreting, next_pow2, tl, triton, use_triton
from .kv_quant import is_fp8, quantize_kv

# Triton 3.9's interpreter casts fp32 → e4m3 wrongly where rounding carries into the exponent
# (31.5 becomes 16, not 32); under it, values are rounded to e4m3 in fp32 first, so its cast is
# exact. Compiled kernels leave the cast to the hardware (round to nearest even, as torch).
_ROUND_FIRST = tl.constexpr(interpreting()) if HAS_TRITON else False


@triton.jit
def _round_to_e4m3(y):
    """y (fp32, |y| <= 448) rounded to nearest-even e4m3, still fp32: normal numbers keep 3
    mantissa bits (carry into the exponent included), subnormals are multiples of 2^-9."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = (tl.abs(y) + 24576.0) - 24576.0  # 1.5 * 2^14: its fp32 ulp is 2^-9
    sub = tl.where(bits < 0, -sub, sub)
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def quantize_rows(x, scale, QUANT: tl.constexpr, Out):
    """x in Out's element type; QUANT: clamp(x / scale, ±448) in fp32 first (kv_quant's fp8 rule;
    448 = FP8_MAX, written out because a jit function reads no plain globals)."""
    if QUANT:
        y = x.to(tl.float32) / scale
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if _ROUND_FIRST:
            y = _round_to_e4m3(y)
        return y.to(Out.dtype.element_ty)
    else:
        return x.to(Out.dtype.element_ty)


@triton.jit
def _kv_store_kernel(
    K,
    V,
    Kbuf,
    Vbuf,
    Loc,
    KScale,
    VScale,
    stride_kt,
    stride_vt,
    stride_bk,
    stride_bv,
    row_size,
    head_dim,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    slot = tl.load(Loc + t).to(tl.int64)
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
    ks = 1.0
    vs = 1.0
    if QUANT:
        ks = tl.load(KScale + offs // head_dim, mask=mask, other=1.0)
        vs = tl.load(VScale + offs // head_dim, mask=mask, other=1.0)
    tl.store(Kbuf + slot * stride_bk + offs, quantize_rows(k, ks, QUANT, Kbuf), mask=mask)
    tl.store(Vbuf + slot * stride_bv + offs, quantize_rows(v, vs, QUANT, Vbuf), mask=mask)


def kv_store(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_buffer[loc] = k; v_buffer[loc] = v. k/v [T, Hkv, D]; buffers [S, Hkv, D] contiguous rows.
    fp8 buffers quantize with k_scale / v_scale ([Hkv] fp32, None = all 1)."""
    if k.shape != v.shape or k.shape[1:] != k_buffer.shape[1:] or loc.shape[0] != k.shape[0]:
        raise ValueError(
            f"kv_store shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"buffer {tuple(k_buffer.shape)}, loc {tuple(loc.shape)}"
        )
    if (
        k_buffer.stride(1) != k_buffer.shape[2]
        or k_buffer.stride(2) != 1
        or v_buffer.stride() != k_buffer.stride()
    ):
        raise ValueError("KV buffers need contiguous [Hkv, D] rows with equal strides")
    quant = is_fp8(k_buffer.dtype)
    if quant:
        k_scale = k_scale if k_scale is not None else _ones(k_buffer)
        v_scale = v_scale if v_scale is not None else _ones(k_buffer)
    if not use_triton(k):
        kv_store_ref(k_buffer, v_buffer, loc, k, v, k_scale, v_scale)
        return
    t = k.shape[0]
    row = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(t, row), v.reshape(t, row)
    if k2.stride(-1) != 1 or v2.stride(-1) != 1:
        k2, v2 = k2.contiguous(), v2.contiguous()
    block = min(1024, next_pow2(row))
    if t:
        _kv_store_kernel[(t, triton.cdiv(row, block))](
            k2,
            v2,
            k_buffer,
            v_buffer,
            loc,
            k_scale if quant else loc,  # unused unless QUANT
            v_scale if quant else loc,
            k2.stride(0),
            v2.stride(0),
            k_buffer.stride(0),
            v_buffer.stride(0),
            row,
            k.shape[2],
            BLOCK=block,
            QUANT=quant,
            num_warps=4,
            enable_fp_fusion=True,
        )


def _ones(buf: torch.Tensor) -> torch.Tensor:
    return torch.ones(buf.shape[1], dtype=torch.float32, device=buf.device)


def kv_store_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if is_fp8(k_buffer.dtype):
        k_buffer[loc] = quantize_kv(k, k_scale if k_scale is not None else _ones(k_buffer))
        v_buffer[loc] = quantize_kv(v, v_scale if v_scale is not None else _ones(v_buffer))
        return
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)
