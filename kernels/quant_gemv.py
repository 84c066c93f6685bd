"""Matmul over GGUF blocks on the GPU: y [M, N] = x [M, K] @ W^T for W kept as Q4_0 / Q4_1 / Q8_0 / Q4_K,
in the arrays `quant_gpu_layout.repack` makes (quants, fp16 scales and offsets), dequantized
inside the loop so each weight byte is read once. Decode rows run on CUDA
cores (kinds "acc" and "fma"; one 16-bit row by default "dp4a", x rounded to int8 in the matmul,
in `quant_gemv_dp4a`, or "int8x", x rounded once before it, in `quant_gemv_int8x`, "stream", the
same by persistent programs, in `quant_gemv_stream`, or "half2", packed half arithmetic, in
`quant_gemv_half2`), more rows dequantize tiles into tensor-core dots (kind "dot"); which kind
runs is `quant_gemv_configs`'s choice. fp32 accumulation, y in x's dtype. Promises: `quant_matmul`
equals `quant_matmul_ref`, the fp32 matmul with `quant_blocks.dequantize_blocks` (itself equal to
gguf's dequantization), to the rounding of the dot's operand dtype ("half2": of its fp16
arithmetic; "dp4a", "int8x", "stream": of x to int8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import dot_precision, mma, tl, triton, use_triton
from .quant_blocks import dequantize_blocks
from .quant_gemv_configs import (
    DEFAULTS,
    DOT,
    DP4A,
    DP4A_LONG_K,
    FMA_MAX_M,
    HALF2,
    KINDS,
    ONE_ROW,
    QuantMatmulConfig,
    choose_config,
    default_config,
)
from .quant_gemv_dp4a import DP4A_FORMATS, FORMAT_KIND, gemv_dp4a
from .quant_gemv_half2 import HALF2_FORMATS, gemv_half2, one_16bit_row
from .quant_gemv_int8x import INT8X_FORMATS, Int8Row, gemv_int8x
from .quant_gemv_stream import gemv_stream
from .quant_gpu_layout import GEMV_FORMATS, GpuBlocks, dequantize, repack


@triton.jit
def _as_float(bits, bias: tl.constexpr):
    """Small non-negative ints (< 2^23, as int32) to float32 minus bias, without a conversion
    instruction: OR-ing in 2^23's exponent gives the float 2^23 + v exactly."""
    return (bits | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _block_values(QS, rows_c, blk, NB, KIND: tl.constexpr, MAGIC: tl.constexpr):
    """The quants of blocks blk of rows rows_c as float32 [BN, BB, 16] pairs (values 0-15 and
    16-31 of each block), Q4_0's -8 included."""
    QB: tl.constexpr = 32 if KIND == 2 else 16
    j = tl.arange(0, 16)
    q_ptr = QS + rows_c[:, None, None] * (NB * QB) + blk[None, :, None] * QB + j[None, None, :]
    if KIND == 2:
        if MAGIC:
            q0 = _as_float(tl.load(q_ptr).to(tl.int32) & 0xFF ^ 0x80, 128.0)
            q1 = _as_float(tl.load(q_ptr + 16).to(tl.int32) & 0xFF ^ 0x80, 128.0)
        else:
            q0 = tl.load(q_ptr).to(tl.int8, bitcast=True).to(tl.float32)
            q1 = tl.load(q_ptr + 16).to(tl.int8, bitcast=True).to(tl.float32)
    else:
        qb = tl.load(q_ptr)
        if MAGIC:
            qi = qb.to(tl.int32)
            q0 = _as_float(qi & 0x0F, 8.0 if KIND == 0 else 0.0)
            q1 = _as_float(qi >> 4, 8.0 if KIND == 0 else 0.0)
        else:
            q0 = (qb & 0x0F).to(tl.float32)
            q1 = (qb >> 4).to(tl.float32)
            if KIND == 0:
                q0 -= 8.0
                q1 -= 8.0
    return q0, q1


@triton.jit
def _block_scales(D, MN, rows_c, b0, bb, NB, KIND: tl.constexpr, EVEN_B: tl.constexpr):
    """Blocks b0 + bb of rows rows_c: their index (clamped to the last block), scale d and, for
    Q4_1, offset m, both float32 [BN, BB] and zero past the last block."""
    blk = tl.minimum(b0 + bb, NB - 1) if not EVEN_B else b0 + bb
    d = tl.load(D + rows_c[:, None] * NB + blk[None, :]).to(tl.float32)
    if not EVEN_B:
        d = tl.where((b0 + bb)[None, :] < NB, d, 0.0)
    mn = d
    if KIND == 1:
        mn = tl.load(MN + rows_c[:, None] * NB + blk[None, :]).to(tl.float32)
        if not EVEN_B:
            mn = tl.where((b0 + bb)[None, :] < NB, mn, 0.0)
    return blk, d, mn


@triton.jit
def _gemv1_kernel(
    X,
    QS,
    D,
    MN,
    Y,
    N,
    NB,
    KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_B: tl.constexpr,
    MAGIC: tl.constexpr,
):
    """One row of x: products accumulate elementwise over [BN, BB, 16] and are reduced once at
    the end (a reduction per block would cost more than the block's FMAs)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read row N-1; never stored
    bb = tl.arange(0, BLOCK_B)
    j = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, BLOCK_B, 16), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        blk, d, mn = _block_scales(D, MN, rows_c, b0, bb, NB, KIND, EVEN_B)  # [BN, BB]
        q0, q1 = _block_values(QS, rows_c, blk, NB, KIND, MAGIC)
        x_ptr = X + blk[:, None] * 32 + j[None, :]
        x0 = tl.load(x_ptr).to(tl.float32)[None, :, :]
        x1 = tl.load(x_ptr + 16).to(tl.float32)[None, :, :]
        if KIND == 1:
            acc += (q0 * d[:, :, None] + mn[:, :, None]) * x0 + (q1 * d[:, :, None] + mn[:, :, None]) * x1
        else:
            acc += (q0 * x0 + q1 * x1) * d[:, :, None]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


@triton.jit
def _fma_kernel(
    X,
    QS,
    D,
    MN,
    Y,
    N,
    NB,
    stride_xm,
    stride_ym,
    KIND: tl.constexpr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_B: tl.constexpr,
    MAGIC: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N re-read row N-1; never stored
    bb = tl.arange(0, BLOCK_B)
    j = tl.arange(0, 16)
    m_idx = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        blk, d, mn = _block_scales(D, MN, rows_c, b0, bb, NB, KIND, EVEN_B)  # [BN, BB]
        q0, q1 = _block_values(QS, rows_c, blk, NB, KIND, MAGIC)
        for mi in tl.static_range(M):
            x_ptr = X + mi * stride_xm + blk[:, None] * 32 + j[None, :]
            x0 = tl.load(x_ptr).to(tl.float32)  # [BB, 16]
            x1 = tl.load(x_ptr + 16).to(tl.float32)
            part = d * tl.sum(q0 * x0[None, :, :] + q1 * x1[None, :, :], axis=2)  # [BN, BB]
            if KIND == 1:
                part += mn * tl.sum(x0 + x1, axis=1)[None, :]
            acc += tl.where(m_idx[:, None] == mi, tl.sum(part, axis=1)[None, :], 0.0)
    mask = (m_idx[:, None] < M) & (rows[None, :] < N)
    tl.store(Y + m_idx[:, None] * stride_ym + rows[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dot_kernel(
    X,
    QS,
    D,
    MN,
    Y,
    M,
    N,
    NB,
    stride_xm,
    stride_ym,
    KIND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_B: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    QB: tl.constexpr = 32 if KIND == 2 else 16
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    m_c = tl.minimum(offs_m, M - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_B * QB)  # quant bytes of BLOCK_B blocks, along K
    kb = kk // QB  # block of each byte
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        blk = tl.minimum(b0 + kb, NB - 1) if not EVEN_B else b0 + kb  # [BB * QB]
        d = tl.load(D + rows_c[None, :] * NB + blk[:, None]).to(tl.float32)  # [BB*QB, BN]
        if not EVEN_B:
            d = tl.where((b0 + kb)[:, None] < NB, d, 0.0)
        q_ptr = QS + rows_c[None, :] * (NB * QB) + (blk * QB + kk % QB)[:, None]
        x_ptr = X + m_c[:, None] * stride_xm + (blk * 32 + kk % QB)[None, :]
        if KIND == 2:
            w = (_as_float(tl.load(q_ptr).to(tl.int32) & 0xFF ^ 0x80, 128.0) * d).to(X.dtype.element_ty)
            acc += mma(tl.load(x_ptr), w, DOT_PREC)
        else:
            qb = tl.load(q_ptr).to(tl.int32)
            if KIND == 0:
                w_lo = (_as_float(qb & 0x0F, 8.0) * d).to(X.dtype.element_ty)
                w_hi = (_as_float(qb >> 4, 8.0) * d).to(X.dtype.element_ty)
            else:
                lo = _as_float(qb & 0x0F, 0.0)
                hi = _as_float(qb >> 4, 0.0)
                mn = tl.load(MN + rows_c[None, :] * NB + blk[:, None]).to(tl.float32)
                if not EVEN_B:
                    mn = tl.where((b0 + kb)[:, None] < NB, mn, 0.0)
                w_lo = (lo * d + mn).to(X.dtype.element_ty)
                w_hi = (hi * d + mn).to(X.dtype.element_ty)
            acc += mma(tl.load(x_ptr), w_lo, DOT_PREC)
            acc += mma(tl.load(x_ptr + 16), w_hi, DOT_PREC)
    mask = (offs_m[:, None] < M) & (rows[None, :] < N)
    tl.store(Y + offs_m[:, None] * stride_ym + rows[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def _validate(x: torch.Tensor, w: GpuBlocks) -> None:
    if x.dim() != 2 or x.shape[1] != w.cols:
        raise ValueError(f"quant_matmul needs x [M, {w.cols}], got {tuple(x.shape)}")
    if x.shape[0] < 1:
        raise ValueError("quant_matmul needs at least one row of x")


INT8_ROW_KINDS = ("int8x", "stream")  # the kinds that take x rounded to int8 beforehand


def _check_one_row_kind(kind: str, x: torch.Tensor, qtype: str) -> None:
    """The packed one-row kinds serve one 16-bit row of their formats; anything else is refused."""
    served = {"half2": HALF2_FORMATS, "dp4a": DP4A_FORMATS, "int8x": INT8X_FORMATS, "stream": INT8X_FORMATS}
    if kind in served and not (qtype in served[kind] and one_16bit_row(x)):
        raise ValueError(
            f"quant_matmul kind {kind!r} serves one bf16/fp16 row of {', '.join(served[kind])} "
            f"weights, got M={x.shape[0]}, {x.dtype}, {qtype}"
        )


def takes_int8_row(x: torch.Tensor, w: GpuBlocks) -> bool:
    """Whether `quant_matmul(x, w)` runs a kind that takes x rounded to int8 ("int8x", "stream")
    on a Triton device, so that x rounded by the op that writes it
    (`quant_gemv_int8x.round_groups`) saves it a launch."""
    return x.dim() == 2 and use_triton(x) and choose_config(x, w).kind in INT8_ROW_KINDS


def quant_matmul(
    x: torch.Tensor, w: GpuBlocks, config: QuantMatmulConfig | None = None, x_int8: Int8Row | None = None
) -> torch.Tensor:
    """y [M, N] = x @ dequantize(w)^T, one launch (kind "int8x": two, or one given x_int8, x
    already rounded); the torch reference where Triton is off."""
    _validate(x, w)
    m, n, nb = x.shape[0], w.rows, w.cols // 32
    cfg = config or choose_config(x, w)
    _check_one_row_kind(cfg.kind, x, w.qtype)
    if cfg.kind == "fma" and m > FMA_MAX_M:
        raise ValueError(f"quant_matmul kind 'fma' serves 1..{FMA_MAX_M} rows, got M={m}")
    if cfg.kind == "acc" and m != 1:
        raise ValueError(f"quant_matmul kind 'acc' serves one row, got M={m}")
    if not use_triton(x):
        return quant_matmul_ref(x, w)
    if cfg.kind == "half2":
        return gemv_half2(x, w.qs, w.d, w.m, w.qtype, cfg.block_n, cfg.block_k // 32, cfg.num_warps)
    if x_int8 is not None and cfg.kind not in INT8_ROW_KINDS:
        raise ValueError(
            f"quant_matmul takes x rounded to int8 for kinds 'int8x', 'stream', not {cfg.kind!r}"
        )
    k = (cfg.block_n, cfg.block_k // 32, cfg.num_warps, cfg.num_stages)
    if cfg.kind == "int8x":
        return gemv_int8x(x, w.qs, w.d, w.m, w.qtype, *k, x_int8=x_int8)
    if cfg.kind == "stream":
        return gemv_stream(x, w.qs, w.d, w.m, w.qtype, *k, cfg.programs_per_sm, x_int8=x_int8)
    if cfg.kind == "dp4a":
        return gemv_dp4a(
            x, w.qs, w.d, w.m, w.qtype, cfg.block_n, cfg.block_k // 32, cfg.num_warps, cfg.num_stages
        )
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_b = min(cfg.block_k // 32, triton.next_power_of_2(nb))
    args = (w.qs, w.d, w.m if w.m is not None else w.d, y)
    common = dict(KIND=FORMAT_KIND[w.qtype], BLOCK_N=cfg.block_n, BLOCK_B=block_b, EVEN_B=nb % block_b == 0)
    if cfg.kind == "acc":
        _gemv1_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, *args, n, nb, MAGIC=cfg.magic, num_warps=cfg.num_warps, **common, enable_fp_fusion=True
        )
    elif cfg.kind == "fma":
        _fma_kernel[(triton.cdiv(n, cfg.block_n),)](
            x,
            *args,
            n,
            nb,
            x.stride(0),
            y.stride(0),
            M=m,
            BLOCK_M=max(2, triton.next_power_of_2(m)),
            MAGIC=cfg.magic,
            num_warps=cfg.num_warps,
            **common,
            enable_fp_fusion=True,
        )
    else:
        _dot_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
            x,
            *args,
            m,
            n,
            nb,
            x.stride(0),
            y.stride(0),
            BLOCK_M=cfg.block_m,
            DOT_PREC=dot_precision(x.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **common,
            enable_fp_fusion=True,
        )
    return y


def quant_matmul_ref(x: torch.Tensor, w: GpuBlocks) -> torch.Tensor:
    """fp32 F.linear with the dequantized weight, cast to x's dtype."""
    return F.linear(x.float(), dequantize(w)).to(x.dtype)


def quant_matmul_raw_ref(x: torch.Tensor, raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """The same from ggml's own block bytes (`dequantize_blocks`): the independent reference."""
    return F.linear(x.float(), dequantize_blocks(raw, qtype)).to(x.dtype)


__all__ = [
    "DEFAULTS",
    "DOT",
    "DP4A",
    "DP4A_FORMATS",
    "DP4A_LONG_K",
    "FMA_MAX_M",
    "GEMV_FORMATS",
    "GpuBlocks",
    "HALF2",
    "HALF2_FORMATS",
    "INT8X_FORMATS",
    "INT8_ROW_KINDS",
    "KINDS",
    "ONE_ROW",
    "QuantMatmulConfig",
    "choose_config",
    "default_config",
    "dequantize",
    "quant_matmul",
    "quant_matmul_raw_ref",
    "quant_matmul_ref",
    "repack",
    "takes_int8_row",
]
