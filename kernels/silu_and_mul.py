"""SiLU-and-mul, the gated MLP activation: silu(gate) * up in one pass, fp32 math, one rounding.
Promises: `silu_and_mul(x)` on x = [..., 2I] (gate first, as a fused gate_up projection
writes it) and `silu_mul(gate, up)` both equal their `*_ref`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton, use_triton


@triton.jit
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shape tensors whose last dimension is contiguous."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if not use_triton(gate):
        return silu_mul_ref(gate, up)
    shape = gate.shape
    g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    n_rows, n_cols = g2.shape
    block = 1024
    if n_rows and n_cols:
        _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4
        )
    return out.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] → silu(x[..., :I]) * x[..., I:]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    half = x.shape[-1] // 2
    return silu_mul(x[..., :half], x[..., half:])


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return silu_mul_ref(x[..., :half], x[..., half:])
