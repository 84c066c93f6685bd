"""Decode-sized matmul over FP8 e4m3 weights with one float32 scale per output row:
y [M, N] = x [M, K] @ (W_fp8 * scale[:, None])^T (+ bias) for few rows (M <= MAX_M), weight-only
(activations stay in their dtype). Each program streams BLOCK_N weight rows over K once (1 byte per
weight, half of bf16's) and reuses each tile for all M rows; fp32 accumulation, the row scale
applied once at the end. Promises: `fp8_gemv` equals `fp8_gemv_ref` to fp32 rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import next_pow2, tl, triton, use_triton

MAX_M = 8
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int = 4
    block_k: int = 2048
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"fp8 gemv {name} must be a power of two, got {v}")

    def label(self) -> str:
        return f"n{self.block_n} k{self.block_k} w{self.num_warps}"


DEFAULT = Fp8GemvConfig()


@triton.jit
def _fp8_gemv_kernel(
    X,
    W,
    WS,
    B,
    Y,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)  # rows past N re-read row N-1 (unmasked loads); never stored
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows_in.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    m_idx = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0).to(tl.float32)
        for m in tl.static_range(M):
            if EVEN_K:
                xm = tl.load(X + m * stride_xm + k0 + offs_k).to(tl.float32)
            else:
                xm = tl.load(X + m * stride_xm + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :], axis=1)
            acc += tl.where(m_idx[:, None] == m, part[None, :], 0.0)
        w_ptrs += BLOCK_K
    acc = acc * tl.load(WS + rows_in)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + rows_in).to(tl.float32)[None, :]
    mask = (m_idx[:, None] < M) & (rows[None, :] < N)
    tl.store(Y + m_idx[:, None] * stride_ym + rows[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def fp8_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear in fp32 with the dequantized weight (weight.float() * scale per row), in x's dtype."""
    w = weight.float() * scale.float().reshape(-1, 1)
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), w, b).to(x.dtype)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Fp8GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (weight [N, K] e4m3 * scale [N])^T (+ bias [N]), in x's dtype; one
    launch on CUDA (sm_89+) or the interpreter, fp8_gemv_ref elsewhere. 1 <= M <= MAX_M."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8_gemv needs x [M, K], weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if weight.dtype != FP8_DTYPE or scale.numel() != weight.shape[0]:
        raise ValueError("fp8_gemv needs a float8_e4m3fn weight and one scale per weight row")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"fp8_gemv serves 1..{MAX_M} rows, got M={x.shape[0]}")
    if not use_triton(x):
        return fp8_gemv_ref(x, weight, scale, bias)
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or DEFAULT
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    scale = scale.reshape(-1).contiguous()  # the kernel reads scale and bias at unit stride
    bias = bias.contiguous() if bias is not None else None
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y if n == 0 else fp8_gemv_ref(x, weight, scale, bias)
    block_k = min(cfg.block_k, max(16, next_pow2(k)))
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x,
        weight,
        scale,
        bias if bias is not None else y,
        y,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        M=m,
        BLOCK_M=max(2, next_pow2(m)),
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
    )
    return y


__all__ = ["DEFAULT", "FP8_DTYPE", "MAX_M", "Fp8GemvConfig", "fp8_gemv", "fp8_gemv_ref"]
