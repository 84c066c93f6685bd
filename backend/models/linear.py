"""Which matmul a layer's product runs: the one-row GEMV, a GGUF or FP8 layer's own kernels, or
torch; on the CPU, the packed kernels' native dtype. Promises: `linear(layer, x)` equals
layer(x) to the kernels' rounding, for any row count (none included)."""

from __future__ import annotations

import torch
from torch import nn

from radixlm.kernels.gemv import gemv, use_gemv
from radixlm.kernels.quant_gemv_int8x import Int8Row

from ..fp8_linear import Fp8Linear
from ..quant_linear import QuantLinear

Layer = nn.Linear | QuantLinear | Fp8Linear


def reads_int8(layer: Layer, x: torch.Tensor) -> bool:
    """Whether layer's matmul of x reads x rounded to int8 (a one-row GGUF kernel), so the op
    that writes x should round it too."""
    return isinstance(layer, QuantLinear) and layer.takes_int8_row(x)


def linear(layer: Layer, x: torch.Tensor, x_int8: Int8Row | None = None) -> torch.Tensor:
    """layer(x); one row on CUDA goes to radixlm.kernels.gemv, which streams the weight once
    and beats cuBLAS for a single row; from a few rows up cuBLAS is faster, so it keeps those
    (figures: benchmarks/results/gemv_h200.json). GGUF blocks and FP8 weights run their
    layer's own paths; x_int8, x already rounded, only where `reads_int8(layer, x)`. No rows (the
    LM head of a chunk that needs no logits) give an empty result: not every kernel takes them."""
    if x.shape[0] == 0:
        return x.new_empty(0, layer.out_features)
    if x_int8 is not None:
        assert isinstance(layer, QuantLinear)
        return layer.forward_int8(x, x_int8)
    if isinstance(layer, (QuantLinear, Fp8Linear)):
        return layer(x)
    if x.shape[0] == 1 and use_gemv(x, layer.weight):
        return gemv(x, layer.weight, layer.bias)
    y: torch.Tensor = layer(x)
    return y


def native(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    """layer(x) on the CPU, in the packed matmul's own dtype where it has one (the caller's next
    op promotes or casts: a residual add in float32, the next matmul's bf16 input)."""
    return layer.forward_native(x) if isinstance(layer, QuantLinear) else layer(x)
