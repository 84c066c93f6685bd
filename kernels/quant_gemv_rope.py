"""A decode row's qkv projection with the rotary embedding and the KV-pool store in the same
launch: the "dp4a" one-row matmul over a GGUF qkv weight, each program taking rotate-half pairs of
rows (i and i + D/2 of one head), so its epilogue rotates q and k, writes q out and k and v into
their pool slot (quantized for an fp8 pool). That saves the rotary launch of a decode step.
Promises: equals `gemv_dp4a` followed by `rotary.rotary_and_store` to one rounding of the
rotation (the projection is rounded to x's dtype before it is rotated, as the two launches hold it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import interpreting, pdl_args, pdl_wait, tl, triton, use_triton
from .kv_quant import is_fp8
from .kv_store import kv_store_ref, quantize_rows
from .quant_gemv_configs import DP4A, choose_config
from .quant_gemv_dp4a import DP4A_FORMATS, FORMAT_KIND, dp4a_rows, quantize_x_ref
from .quant_gemv_half2 import aligned_row, one_16bit_row
from .quant_gpu_layout import GpuBlocks, dequantize
from .rotary import rotary_ref

# dp4a's one-row tiles (4 rows: two rotate-half pairs, 32 blocks a tile, 4 warps)
ROPE_CONFIG = DP4A


@triton.jit
def _store_halves(Dst, lo, hi, Scale, HALF: tl.constexpr, QUANT: tl.constexpr, X_DTYPE: tl.constexpr):
    """Both halves of a head's pairs at Dst and Dst + HALF (lo, hi fp32), in Dst's element type;
    QUANT: rounded to X_DTYPE first, then scaled into the fp8 pool."""
    if QUANT:
        s = tl.load(Scale)
        lo = quantize_rows(lo.to(X_DTYPE), s, True, Dst)
        hi = quantize_rows(hi.to(X_DTYPE), s, True, Dst)
    tl.store(Dst, lo.to(Dst.dtype.element_ty))
    tl.store(Dst + HALF, hi.to(Dst.dtype.element_ty))


@triton.jit
def _qkv_rope_store_kernel(
    X4,
    QW,
    D,
    MN,
    Qo,
    Kbuf,
    Vbuf,
    Loc,
    Pos,
    Cache,
    KScale,
    VScale,
    stride_c,
    stride_bt,
    stride_bh,
    NB,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    KIND: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_B: tl.constexpr,
    X_F16: tl.constexpr,
    ASM: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS / 2 pairs per program, all in one head (HALF a multiple of ROWS / 2): rows
    i .. i + R - 1 and their partners i + HALF ..; heads below HQ are q's, then HKV of k, then v."""
    pdl_wait(PDL)
    R: tl.constexpr = ROWS // 2
    pair0 = tl.program_id(0) * R
    head = pair0 // HALF
    i = pair0 % HALF + tl.arange(0, R)
    j = tl.arange(0, ROWS)
    rows = (head * 2 * HALF + pair0 % HALF + j % R + (j // R) * HALF).to(tl.int64)
    y = dp4a_rows(X4, QW, D, MN, rows, NB, KIND, ROWS, BLOCK_B, EVEN_B, X_F16, ASM)
    y = tl.reshape(y.to(Qo.dtype.element_ty).to(tl.float32), (2, R))  # as the projection's output holds it
    half = tl.arange(0, 2)[:, None]
    x1 = tl.sum(tl.where(half == 0, y, 0.0), axis=0)
    x2 = tl.sum(tl.where(half == 1, y, 0.0), axis=0)
    slot = tl.load(Loc).to(tl.int64)
    if head < HQ + HKV:
        pos = tl.load(Pos).to(tl.int64)
        cos = tl.load(Cache + pos * stride_c + i)
        sin = tl.load(Cache + pos * stride_c + HALF + i)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if head < HQ:
            _store_halves(Qo + head * 2 * HALF + i, y1, y2, KScale, HALF, False, Qo.dtype.element_ty)
        else:
            dst = Kbuf + slot * stride_bt + (head - HQ) * stride_bh + i
            _store_halves(dst, y1, y2, KScale + head - HQ, HALF, QUANT, Qo.dtype.element_ty)
    else:
        dst = Vbuf + slot * stride_bt + (head - HQ - HKV) * stride_bh + i
        _store_halves(dst, x1, x2, VScale + head - HQ - HKV, HALF, QUANT, Qo.dtype.element_ty)


def qkv_rope_store(
    x: torch.Tensor,
    w: GpuBlocks,
    heads: tuple[int, int, int],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [1, Hq, D] rotated, for one decode row x [1, K] and the qkv weight w (rows: q's Hq heads,
    then k's and v's Hkv; heads = (Hq, Hkv, D)); rotated k and v go into the pool rows loc[0] of
    k_buffer / v_buffer [S, Hkv, D] (fp8 buffers divided by k_scale / v_scale [Hkv], None = 1).
    cos_sin_cache [P, D] fp32: cos in the first half, sin in the second. Where Triton is off: the
    two references, `qkv_rope_store_ref`."""
    _check(x, w, heads, k_buffer, v_buffer)
    if not use_triton(x):
        return qkv_rope_store_ref(
            x, w, heads, positions, cos_sin_cache, k_buffer, v_buffer, loc, k_scale, v_scale
        )
    hq, hkv, dim = heads
    x = aligned_row(x, 8)
    nb = x.shape[1] // 32
    block_b = min(ROPE_CONFIG.block_k // 32, triton.next_power_of_2(nb))
    rows = ROPE_CONFIG.block_n
    quant = is_fp8(k_buffer.dtype)
    ones = torch.ones(hkv, dtype=torch.float32, device=x.device) if quant else cos_sin_cache
    qo = torch.empty(1, hq, dim, dtype=x.dtype, device=x.device)
    _qkv_rope_store_kernel[((hq + 2 * hkv) * dim // rows,)](
        x.view(torch.int64),
        w.qs.view(torch.int32),
        w.d,
        w.m if w.m is not None else w.d,
        qo,
        k_buffer,
        v_buffer,
        loc,
        positions,
        cos_sin_cache,
        k_scale if k_scale is not None else ones,
        v_scale if v_scale is not None else ones,
        cos_sin_cache.stride(0),
        k_buffer.stride(0),
        k_buffer.stride(1),
        nb,
        HQ=hq,
        HKV=hkv,
        HALF=dim // 2,
        KIND=FORMAT_KIND[w.qtype],
        ROWS=rows,
        BLOCK_B=block_b,
        EVEN_B=nb % block_b == 0,
        X_F16=x.dtype == torch.float16,
        ASM=not interpreting(),
        QUANT=quant,
        num_warps=ROPE_CONFIG.num_warps,
        num_stages=ROPE_CONFIG.num_stages,
        enable_fp_fusion=True,
        **pdl_args(x, "qkv_rope_store"),
    )
    return qo


def qkv_rope_store_ref(
    x: torch.Tensor,
    w: GpuBlocks,
    heads: tuple[int, int, int],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The two steps the kernel fuses, in torch: dp4a's product (x rounded as `quantize_x_ref`,
    the dequantized weight, fp32, rounded to x's dtype), then `rotary_ref` and `kv_store_ref`."""
    hq, hkv, dim = heads
    qkv = F.linear(quantize_x_ref(x), dequantize(w)).to(x.dtype)
    q, k, v = (t.view(1, -1, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    q, k = rotary_ref(q, k, positions, cos_sin_cache)
    kv_store_ref(k_buffer, v_buffer, loc, k, v, k_scale, v_scale)
    return q


def fuses_rope(x: torch.Tensor, w: GpuBlocks, heads: tuple[int, int, int]) -> bool:
    """Whether `qkv_rope_store` serves this projection: one 16-bit row on a Triton device whose
    matmul would take the "dp4a" kind (qkv's, which rounds x inside its programs), and heads whose
    half-dimension splits into the kernel's pairs."""
    hq, hkv, dim = heads
    return (
        use_triton(x)
        and w.qtype in DP4A_FORMATS
        and x.dim() == 2
        and one_16bit_row(x)
        and w.rows == (hq + 2 * hkv) * dim
        and dim % ROPE_CONFIG.block_n == 0
        and choose_config(x, w).kind == "dp4a"
    )


def _check(
    x: torch.Tensor, w: GpuBlocks, heads: tuple[int, int, int], k_buffer: torch.Tensor, v_buffer: torch.Tensor
) -> None:
    hq, hkv, dim = heads
    if w.qtype not in DP4A_FORMATS:
        raise ValueError(f"qkv_rope_store serves {', '.join(DP4A_FORMATS)}, got {w.qtype}")
    if x.dim() != 2 or not one_16bit_row(x) or x.shape[1] != w.cols:
        raise ValueError(
            f"qkv_rope_store takes one bf16/fp16 row of {w.cols} values, got {tuple(x.shape)} {x.dtype}"
        )
    if w.rows != (hq + 2 * hkv) * dim or dim % ROPE_CONFIG.block_n:
        raise ValueError(
            f"qkv weight has {w.rows} rows; heads {heads} need (Hq + 2 Hkv) D, D a multiple of {ROPE_CONFIG.block_n}"
        )
    if k_buffer.shape[1:] != (hkv, dim) or v_buffer.stride() != k_buffer.stride() or k_buffer.stride(2) != 1:
        raise ValueError(f"pool rows {tuple(k_buffer.shape[1:])} must be [{hkv}, {dim}], both buffers alike")


__all__ = ["fuses_rope", "qkv_rope_store", "qkv_rope_store_ref"]
