"""FP8 (e4m3) weights for float checkpoints: Fp8Linear holds W [N, K] as float8_e4m3fn with one
float32 scale per output row (W ≈ weight * weight_scale[:, None]) and the bias in the model dtype.
On CUDA sm_89+ a call quantizes the activations per row (radixlm.kernels.fp8_quant, one launch) and
runs torch._scaled_mm: with row-wise scales where that kernel's output tiles fill the GPU, else with
unit scales (cuBLASLt, which splits K when the output is small) and the row x column scales applied
by one epilogue launch. Up to GEMV_MAX_M rows it reads the fp8 weight through a weight-only GEMV
instead (radixlm.kernels.fp8_gemv). Elsewhere the weight is dequantized per call (correct, not
fast). No path syncs with the host, so all are CUDA-graph safe."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels._triton import HAS_TRITON
from radixlm.kernels.fp8_gemv import MAX_M as GEMV_ROWS_SERVED
from radixlm.kernels.fp8_gemv import fp8_gemv
from radixlm.kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_rows,
    quantize_rows_ref,
    scale_of,
    scale_outer,
)

# rows up to this go to the weight-only GEMV; more rows to _scaled_mm. One row is where the bf16
# GEMV beats cuBLAS (benchmarks/results/gemv_h200.json); benchmarks/fp8_linear.py measures both
# fp8 paths at M = 1..8 to move this
GEMV_MAX_M = 1
# _scaled_mm's fast accumulation (no periodic fp32 promotion inside the tensor-core loop): faster
# on Hopper; its rounding stays well below e4m3's own (tests/test_fp8_linear_gpu.py bounds both)
FAST_ACCUM = True
SCALED_MM_ALIGN = 16  # _scaled_mm wants K and N multiples of 16 (16-byte rows of e4m3)
# The row-wise _scaled_mm runs one CTA per 128 x 128 output tile and does not split K, so a small
# output leaves SMs idle: at M = 128 on the H200 it takes 42.9 us for the 8B shape's down
# projection (32 tiles) where unit scales + epilogue take 28.5, and 37.9 us for gate_up (224
# tiles) where they take 49.3 (benchmarks/results/fp8_linear_h200.json). The row-wise call is
# taken when its tiles number at least ROWWISE_MIN_FILL of the SMs.
ROWWISE_TILE = 128
ROWWISE_MIN_FILL = 0.5
ROW_CHUNK = 4096  # weight rows quantized per step: the float32 copy stays small


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] float8_e4m3fn, scale [N] float32): per output row scale = max(amax, eps) / 448 and
    q = clamp(weight / scale, ±448) rounded to nearest even (radixlm.kernels.fp8_quant's rule)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight needs a 2-D weight, got {tuple(weight.shape)}")
    n, k = weight.shape
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        for r0 in range(0, n, ROW_CHUNK):
            rows = weight[r0 : r0 + ROW_CHUNK].float()
            s = scale_of(rows.abs().amax(dim=1, keepdim=True))
            q[r0 : r0 + ROW_CHUNK] = (rows / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            scale[r0 : r0 + ROW_CHUNK] = s.squeeze(1)
    return q, scale


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rowwise_fills(m: int, n: int, sm_count: int) -> bool:
    """Whether the row-wise _scaled_mm's output tiles for [m, n] keep enough SMs busy."""
    tiles = -(-m // ROWWISE_TILE) * -(-n // ROWWISE_TILE)
    return tiles >= ROWWISE_MIN_FILL * sm_count


@functools.cache
def _fp8_device(index: int) -> bool:
    """Whether CUDA device `index` has e4m3 tensor cores (sm_89 Ada, sm_90 Hopper and later) and
    Triton is there to quantize the activations."""
    return HAS_TRITON and torch.cuda.get_device_capability(index) >= (8, 9)


def runs_fp8_matmuls(device: torch.device) -> bool:
    """Whether Fp8Linear layers on `device` compute in fp8 (else every call dequantizes)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _fp8_device(device.index if device.index is not None else torch.cuda.current_device())


class Fp8Linear(nn.Module):
    """y = x @ (weight * weight_scale[:, None])^T (+ bias), y in x's dtype."""

    bias: torch.Tensor | None
    weight_scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(
                f"Fp8Linear needs a 2-D {FP8_DTYPE} weight, got {weight.dtype} {tuple(weight.shape)}"
            )
        n, k = weight.shape
        if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
            raise ValueError(
                f"Fp8Linear needs a float32 scale per row ({n},), got {tuple(weight_scale.shape)}"
            )
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"Fp8Linear bias shape {tuple(bias.shape)} != ({n},)")
        self.out_features, self.in_features = n, k
        # a Parameter (not a buffer) so `layer.weight` and named_parameters() read as for nn.Linear
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.contiguous())
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        self.mm_aligned = n % SCALED_MM_ALIGN == 0 and k % SCALED_MM_ALIGN == 0

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Fp8Linear:
        """layer's weight quantized per output row (quantize_weight), on layer's device; the bias is
        kept as it is (model dtype)."""
        q, scale = quantize_weight(layer.weight.detach())
        bias = layer.bias.detach().clone() if layer.bias is not None else None
        return cls(q, scale, bias)

    def path(self, x: torch.Tensor) -> str:
        """Which computation forward(x) runs: "gemv" (weight-only, few rows), "scaled_mm"
        (activations quantized per row, row-wise scales), "scaled_mm_unit" (the same operands,
        unit scales and an epilogue) or "dequant" (weight dequantized per call). Host metadata."""
        rows = x.numel() // max(1, self.in_features)
        if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
            return "dequant"
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if not _fp8_device(index):
            return "dequant"
        if 1 <= rows <= min(GEMV_MAX_M, GEMV_ROWS_SERVED):
            return "gemv"
        if not (self.mm_aligned and rows > 0):
            return "dequant"
        return "scaled_mm" if rowwise_fills(rows, self.out_features, _sm_count(index)) else "scaled_mm_unit"

    if TYPE_CHECKING:  # nn.Module.__call__ runs forward (with hooks); torch types it as returning Any

        def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expects {self.in_features} input features, got {x.shape[-1]}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        kind = self.path(x2)
        if kind == "gemv":
            y = fp8_gemv(x2, self.weight, self.weight_scale, self.bias)

        elif kind == "scaled_mm":
            y = self._scaled_mm(x2)
        elif kind == "scaled_mm_unit":
            xq, xs = quantize_rows(x2)
            y = scaled_mm_unit(xq, xs, self.weight, self.weight_scale, self.bias, x2.dtype)
        else:
            y = self.dequantized_forward(x2)
        return y.reshape(*lead, self.out_features)

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x2)
        return scaled_mm_rowwise(xq, xs, self.weight, self.weight_scale, self.bias, x2.dtype)

    def dequantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear in fp32 with the weight dequantized for this call, in x's dtype."""
        w = self.weight.float() * self.weight_scale.view(-1, 1)
        b = self.bias.float() if self.bias is not None else None
        return F.linear(x.float(), w, b).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def scaled_mm_rowwise(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool | None = None,
) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale[:, None])^T (+ bias) through torch._scaled_mm with row-wise
    scales: xq [M, K] row-major e4m3 and x_scale [M, 1]; wq [N, K] e4m3 passed as its transpose
    (column-major [K, N], as _scaled_mm wants mat2) and w_scale as [1, N]; both scales float32
    and contiguous. The op writes bf16 (its row-wise output type on every torch that has it) and
    takes a bias only in that dtype; other dtypes are cast and biased after. fast_accum: None
    means FAST_ACCUM."""
    fused_bias = bias if bias is not None and bias.dtype == torch.bfloat16 else None
    y = torch._scaled_mm(
        xq,
        wq.t(),
        scale_a=x_scale,
        scale_b=w_scale.view(1, -1),
        bias=fused_bias,
        out_dtype=torch.bfloat16,
        use_fast_accum=FAST_ACCUM if fast_accum is None else fast_accum,
    )
    if out_dtype != torch.bfloat16:
        y = y.to(out_dtype)
    if bias is not None and fused_bias is None:
        y = y + bias.to(out_dtype)
    return y


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def scaled_mm_unit(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What scaled_mm_rowwise computes, as torch._scaled_mm with unit tensor-wise scales into
    float32 (cuBLASLt's fp8 GEMM, fast accumulation) followed by one launch that multiplies row i,
    column j by x_scale[i] * w_scale[j] and adds the bias."""
    one = _unit_scale(xq.device)
    acc = torch._scaled_mm(
        xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=FAST_ACCUM
    )
    return scale_outer(acc, x_scale, w_scale, bias, out_dtype)


def fp8_linear_ref(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the "scaled_mm" path computes, in fp32 torch: x quantized per row like
    radixlm.kernels.fp8_quant, both operands dequantized, F.linear, + bias (float32 result)."""
    x2 = x.reshape(-1, layer.in_features)
    xq, xs = quantize_rows_ref(x2)
    w = layer.weight.float() * layer.weight_scale.view(-1, 1)
    b = layer.bias.float() if layer.bias is not None else None
    y = F.linear(xq.float() * xs, w, b)
    return y.reshape(*x.shape[:-1], layer.out_features)


__all__ = [
    "FAST_ACCUM",
    "GEMV_MAX_M",
    "Fp8Linear",
    "fp8_linear_ref",
    "quantize_weight",
    "rowwise_fills",
    "scaled_mm_rowwise",
    "scaled_mm_unit",
]
