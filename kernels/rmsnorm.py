"""Fused RMSNorm, optionally with the residual add before it (one pass over the row), and for one
row optionally rounded to int8 as well for the next matmul (`quant_gemv_int8x`). Promises:
matches HF Llama's order of rounding — residual sum rounded to the input dtype, normalised in
fp32, rounded, then scaled by the weight — i.e. `rmsnorm_ref` / `fused_add_rmsnorm_ref`; the
int8 row is `quantize_x_int8` of the normalised output, exactly."""

from __future__ import annotations

import torch

from ._triton import next_pow2, pdl_args, pdl_wait, tl, triton, use_triton
from .quant_gemv_int8x import Int8Row, round_groups


@triton.jit
def _rmsnorm_kernel(
    X,
    R,
    W,
    Y,
    Rout,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    Q,
    S,
    OFF,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x.to(tl.float32) + tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(Y.dtype.element_ty)
        tl.store(Rout + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = (xf * inv).to(Y.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)
    if ROUND:  # one row: read back as stored (every thread's stores first), rounded per group
        tl.debug_barrier()
        round_groups(Y, Q, S, OFF, 0, n_cols // 32, BLOCK // 32)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rounded: Int8Row | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"RMSNorm weight has {weight.shape[0]} entries, rows have {x.shape[-1]}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = r_out = None
    if residual is not None:
        r2 = residual.reshape(-1, shape[-1]).contiguous()
        r_out = torch.empty_like(y)
    n_rows, n_cols = x2.shape
    arrays = (rounded.q, rounded.scales, rounded.offsets) if rounded is not None else (y, y, y)
    if n_rows:
        block = next_pow2(n_cols)
        _rmsnorm_kernel[(n_rows,)](
            x2,
            r2 if r2 is not None else x2,
            weight,
            y,
            r_out if r_out is not None else y,
            x2.stride(0),
            r2.stride(0) if r2 is not None else 0,
            y.stride(0),
            r_out.stride(0) if r_out is not None else 0,
            *arrays,
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            ROUND=rounded is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            enable_fp_fusion=rounded is None,  # the rounding is torch's only without contraction
            **pdl_args(x2, "rmsnorm"),
        )
    return y.view(shape), (r_out.view(shape) if r_out is not None else None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = weight * normalise(x) over the last dimension."""
    if not use_triton(x):
        return rmsnorm_ref(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): the new residual stream and its normalised form."""
    if x.shape != residual.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
    if not use_triton(x):
        return fused_add_rmsnorm_ref(x, residual, weight, eps)
    y, r = _launch(x, residual, weight, eps)
    assert r is not None
    return y, r


def rmsnorm_int8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor | None, Int8Row]:
    """(rmsnorm of x (+ residual), x + residual or None, that output rounded to int8) for one row
    x [1, K], K a multiple of 32, on a Triton device: one launch where the norm and
    `quantize_x_int8` would take two."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] % 32:
        raise ValueError(f"rmsnorm_int8 takes one row of a multiple of 32 values, got {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
    if not use_triton(x):
        raise ValueError("rmsnorm_int8 runs on a CUDA device (or Triton's interpreter)")
    rounded = Int8Row.empty(x.shape[1], x.device)
    y, r = _launch(x, residual, weight, eps, rounded)
    return y, r, rounded


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf.to(x.dtype).float()).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    r = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(r, weight, eps), r
