"""RMSNorm with the residual add fused into it: one Triton pass on CUDA, one C call for a few
float32 rows on the CPU (radixlm.kernels.cpu_decode), torch ops otherwise; for one row that a GGUF
matmul reads as int8, the rounding in the same launch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import cpu_decode
from radixlm.kernels.quant_gemv_int8x import Int8Row
from radixlm.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm_int8
from radixlm.kernels.rmsnorm import rmsnorm as fused_rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one Triton pass (radixlm.kernels.rmsnorm); CPU keeps the torch ops below
            return fused_rmsnorm(x, self.weight, self.eps)
        if x.dim() == 2 and few_f32_rows(x, self.weight) and cpu_decode.available():
            return cpu_decode.add_rmsnorm(x, None, self.weight, self.eps)[0]  # as the one-call loop
        if x.dtype == self.weight.dtype == torch.float32:  # one op, not ten: decode is op-bound
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum rounded to x's dtype first (as HF does)."""
        if x.is_cuda:
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if few_f32_rows(x, residual, self.weight) and cpu_decode.available():  # one C call, not ten ops
            return cpu_decode.add_rmsnorm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual

    def forward_int8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, Int8Row]:
        """(norm(x (+ residual)), the residual stream, the norm rounded to int8) for one row on a
        Triton device, in one launch."""
        y, summed, rounded = rmsnorm_int8(x, residual, self.weight, self.eps)
        return y, x if summed is None else summed, rounded


def few_f32_rows(*ts: torch.Tensor) -> bool:
    """Whether ts[0] has rows for the CPU decode calls and all of ts are float32 and contiguous."""
    return ts[0].shape[0] <= cpu_decode.MAX_ROWS and all(
        t.dtype == torch.float32 and t.is_contiguous() for t in ts
    )
