"""Decode-sized matmul over FP8 e4m3 weights with one float32 scale per output row:
y [M, N] = x [M, K] @ (W_fp8 * scale[:, None])^T (+ bias) for few rows (M <= MAX_M), weight-only
(activations stay in their dtype): radixlm.kernels.gemv's CUDA-core kernel reading the e4m3 rows
(1 byte per weight, half of bf16's), the row scale applied once per output. Promises: `fp8_gemv` equals `fp8_gemv_ref` to fp32 rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import use_triton
from .gemv import GemvConfig, launch_gemv

MAX_M = 8
FP8_DTYPE = torch.float8_e4m3fn

# n4 k2048 w4 measured fastest summed over the 8B shapes (benchmarks/results/fp8_linear_h200.json)
DEFAULT = GemvConfig("fma", 4, 2048, 4, 3)


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
    config: GemvConfig | None = None,
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
    return launch_gemv(x, weight, bias, config or DEFAULT, out, scale=scale)


__all__ = ["DEFAULT", "FP8_DTYPE", "MAX_M", "fp8_gemv", "fp8_gemv_ref"]
