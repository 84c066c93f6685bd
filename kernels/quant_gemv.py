"""Decode GEMV over GGUF blocks: y [M, N] = x [M, K] @ W^T for W kept as Q4_0 / Q4_1 / Q8_0
blocks (uint8 raw [N, K / 32 * bytes]), dequantized inside the loop so each weight byte is read
once; fp32 accumulation, y in x's dtype. Promises: `quant_gemv` equals `quant_gemv_ref`, the
fp32 matmul with `quant_blocks.dequantize_blocks` (itself equal to gguf's dequantization)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton, use_triton
from .quant_blocks import BLOCKS, dequantize_blocks

GEMV_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
MAX_M = 8
_KIND = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


@triton.jit
def _half_at(ptr):
    """The little-endian fp16 at byte pointer ptr, as fp32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quant_gemv_kernel(
    X,
    W,
    Y,
    N,
    NB,
    stride_xm,
    stride_wn,
    stride_ym,
    KIND: tl.constexpr,
    BYTES: tl.constexpr,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N re-read row N-1 (loads stay unmasked on rows); their outputs are never stored
    row_ptr = W + tl.minimum(rows, N - 1).to(tl.int64)[:, None, None] * stride_wn
    bb = tl.arange(0, BLOCK_B)
    j = tl.arange(0, 16)
    m_idx = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        blk = b0 + bb
        bmask = blk < NB
        blk_ptr = row_ptr + tl.minimum(blk, NB - 1)[None, :, None] * BYTES  # [BN, BB, 1]
        d = tl.where(bmask[None, :], tl.sum(_half_at(blk_ptr), axis=2), 0.0)  # [BN, BB]
        if KIND == 2:  # Q8_0: d, then 32 int8 values
            lo = tl.load(blk_ptr + 2 + j[None, None, :]).to(tl.int8, bitcast=True).to(tl.float32)
            hi = tl.load(blk_ptr + 18 + j[None, None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        else:  # Q4_0: d, 16 bytes; Q4_1: d, m, 16 bytes. Low nibbles are values 0-15.
            qs = tl.load(blk_ptr + (2 if KIND == 0 else 4) + j[None, None, :])
            lo = (qs & 0x0F).to(tl.float32)
            hi = (qs >> 4).to(tl.float32)
        if KIND == 1:
            mn = tl.where(bmask[None, :], tl.sum(_half_at(blk_ptr + 2), axis=2), 0.0)
        for m in tl.static_range(M):
            x_ptr = X + m * stride_xm + tl.minimum(blk, NB - 1)[:, None] * 32 + j[None, :]
            xlo = tl.load(x_ptr).to(tl.float32)  # [BB, 16]
            xhi = tl.load(x_ptr + 16).to(tl.float32)
            dots = tl.sum(lo * xlo[None, :, :] + hi * xhi[None, :, :], axis=2)  # [BN, BB]
            if KIND == 0:
                dots -= 8.0 * tl.sum(xlo + xhi, axis=1)[None, :]
            part = d * dots
            if KIND == 1:
                part += mn * tl.sum(xlo + xhi, axis=1)[None, :]
            acc += tl.where(m_idx[:, None] == m, tl.sum(part, axis=1)[None, :], 0.0)
    mask = (m_idx[:, None] < M) & (rows[None, :] < N)
    tl.store(Y + m_idx[:, None] * stride_ym + rows[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def _validate(x: torch.Tensor, raw: torch.Tensor, qtype: str, cols: int) -> None:
    if qtype not in GEMV_FORMATS:
        raise ValueError(f"quant_gemv serves {', '.join(GEMV_FORMATS)}, got {qtype}")
    nbytes, nvalues = BLOCKS[qtype]
    if x.dim() != 2 or x.shape[1] != cols or cols % nvalues:
        raise ValueError(
            f"quant_gemv needs x [M, {cols}] with K a multiple of {nvalues}, got {tuple(x.shape)}"
        )
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != cols // nvalues * nbytes:
        raise ValueError(
            f"quant_gemv: raw must be uint8 [N, {cols // nvalues * nbytes}], got {tuple(raw.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"quant_gemv serves 1..{MAX_M} rows, got M={x.shape[0]}")


def quant_gemv(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: str,
    cols: int,
    block_n: int = 16,
    block_b: int = 8,
    num_warps: int = 4,
) -> torch.Tensor:
    """y [M, N] = x @ dequantize(raw)^T, one launch; the torch reference where Triton is off."""
    _validate(x, raw, qtype, cols)
    if not use_triton(x):
        return quant_gemv_ref(x, raw, qtype)
    x = x.contiguous()
    raw = raw.contiguous()
    m, n = x.shape[0], raw.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    _quant_gemv_kernel[grid](
        x,
        raw,
        y,
        n,
        cols // 32,
        x.stride(0),
        raw.stride(0),
        y.stride(0),
        KIND=_KIND[qtype],
        BYTES=BLOCKS[qtype][0],
        M=m,
        BLOCK_M=max(2, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_B=block_b,
        num_warps=num_warps,
    )
    return y


def quant_gemv_ref(x: torch.Tensor, raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """fp32 F.linear with the dequantized blocks, cast to x's dtype."""
    return F.linear(x.float(), dequantize_blocks(raw, qtype)).to(x.dtype)


__all__ = ["GEMV_FORMATS", "MAX_M", "quant_gemv", "quant_gemv_ref"]
