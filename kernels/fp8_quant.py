"""Dynamic per-row (per-token) FP8 e4m3 quantization in one launch: each program reads one row,
takes its amax, and writes the row as e4m3 with one float32 scale (x ≈ q * scale); and the
epilogue of an fp8 GEMM run with unit scales (acc * row_scale * col_scale + bias, in one launch).
Promises: `quantize_rows` equals `quantize_rows_ref` bit for bit (on CUDA and under the
interpreter); `scale_outer` equals `scale_outer_ref` up to the rounding of its output dtype."""

from __future__ import annotations

import torch

from ._triton import interpreting, next_pow2, tl, triton, use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
AMAX_EPS = 1e-12  # an all-zero row gets scale AMAX_EPS / FP8_MAX instead of 0 (no 0/0)
MAX_BLOCK = 16384  # rows up to this width are read once; wider rows are read twice


INV_FP8_MAX = 1.0 / FP8_MAX


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The dequantization scale for rows whose largest magnitude is amax (float32). A product with
    the reciprocal, not a division: torch's CUDA division by a scalar multiplies by the
    reciprocal while its CPU one divides, and the kernel must match both."""
    return amax.float().clamp(min=AMAX_EPS) * INV_FP8_MAX


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8_e4m3fn, scale [M, 1] float32) with q = clamp(x / scale, ±448) rounded to
    nearest even, scale = max(amax(|row|), AMAX_EPS) / 448. Plain torch; x [M, K] any float."""
    xf = x.float()
    scale = scale_of(xf.abs().amax(dim=-1, keepdim=True))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@triton.jit
def _round_e4m3(v):
    """v (float32, |v| <= 448) rounded to nearest even on the e4m3 grid, still float32: the cast
    that follows is then exact. Used under the interpreter only, whose cast loses a mantissa
    carry into the exponent (126.8 becomes 64); compiled kernels keep the hardware cast."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # normal e4m3 (|v| >= 2**-6): keep 3 of float32's 23 mantissa bits, ties to even
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = kept.to(tl.float32, bitcast=True)
    # subnormal e4m3 (|v| < 2**-6): multiples of 2**-9; adding 2**23 rounds v * 2**9 to an integer
    sub = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0.0 stays -0.0


@triton.jit
def _quant_rows_kernel(
    X,
    Q,
    S,
    K,
    stride_xm,
    stride_qm,
    FP8_MAX: tl.constexpr,
    AMAX_EPS: tl.constexpr,
    INV_MAX: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    q_row = Q + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_BLOCK:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_EPS) * INV_MAX
        # q by IEEE division (div_rn), not Triton's default approximate one: bit-equal to the reference
        q = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        if ROUND_FIRST:
            q = _round_e4m3(q)
        tl.store(q_row + offs, q.to(Q.dtype.element_ty), mask=mask)
    else:
        peak = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(x))
        scale = tl.maximum(tl.max(peak, axis=0), AMAX_EPS) * INV_MAX
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.math.div_rn(x, tl.zeros_like(x) + scale)
            q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
            if ROUND_FIRST:
                q = _round_e4m3(q)
            tl.store(q_row + k0 + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


def quantize_rows(x: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref(x) in one Triton launch (CUDA sm_89+, or the interpreter); elsewhere the
    reference. x [M, K] with unit stride along K (other layouts are copied). No host sync."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows needs x [M, K], got {tuple(x.shape)}")
    if not use_triton(x):
        return quantize_rows_ref(x)
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = block_k or min(max(16, next_pow2(k)), MAX_BLOCK)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _quant_rows_kernel[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        FP8_MAX=FP8_MAX,
        AMAX_EPS=AMAX_EPS,
        INV_MAX=INV_FP8_MAX,
        ROUND_FIRST=interpreting(),
        BLOCK_K=block,
        ONE_BLOCK=k <= block,
        num_warps=warps,
        enable_fp_fusion=True,
    )
    return q, scale


def scale_outer_ref(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """acc [M, N] * row_scale [M, 1] * col_scale [N] (+ bias [N]) in float32, cast to out_dtype."""
    y = acc.float() * row_scale.float().view(-1, 1) * col_scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@triton.jit
def _scale_outer_kernel(A, RS, CS, B, OUT, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    y = tl.load(A + m * N + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(RS + m)
    y = y * tl.load(CS + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + m * N + offs, y.to(OUT.dtype.element_ty), mask=mask)


SCALE_BLOCK = 1024


def scale_outer(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """scale_outer_ref in one Triton launch (CUDA, or the interpreter); elsewhere the reference.
    acc [M, N] contiguous, row_scale M float32 values, col_scale N float32 values. No host sync."""
    if acc.dim() != 2 or row_scale.numel() != acc.shape[0] or col_scale.numel() != acc.shape[1]:
        raise ValueError(
            f"scale_outer needs acc [M, N], M row scales and N column scales, got {tuple(acc.shape)}, "
            f"{row_scale.numel()} and {col_scale.numel()}"
        )
    if not use_triton(acc):
        return scale_outer_ref(acc, row_scale, col_scale, bias, out_dtype)
    m, n = acc.shape
    acc = acc.contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=acc.device)
    if m == 0:
        return out
    _scale_outer_kernel[(m, triton.cdiv(n, SCALE_BLOCK))](
        acc,
        row_scale.contiguous(),
        col_scale.contiguous(),
        bias if bias is not None else acc,
        out,
        n,
        HAS_BIAS=bias is not None,
        BLOCK=SCALE_BLOCK,
        enable_fp_fusion=True,
    )
    return out


__all__ = [
    "AMAX_EPS",
    "FP8_DTYPE",
    "FP8_MAX",
    "quantize_rows",
    "quantize_rows_ref",
    "scale_of",
    "scale_outer",
    "scale_outer_ref",
]
