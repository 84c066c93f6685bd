"""SiLU-and-mul, the gated MLP activation: silu(gate) * up in one pass, fp32 math, one rounding;
for one row optionally rounded to int8 as well for the next matmul (`quant_gemv_int8x`).
Promises: `silu_and_mul(x)` on x = [..., 2I] (gate first, as a fused gate_up projection
writes it) and `silu_mul(gate, up)` both equal their `*_ref`; `silu_mul_int8`'s int8 row is
`quantize_x_int8` of its output, exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import pdl_args, pdl_wait, tl, triton, use_triton
from .quant_gemv_int8x import Int8Row, round_groups

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    G,
    U,
    Out,
    Q,
    S,
    OFF,
    stride_g,
    stride_u,
    stride_o,
    n_cols,
    ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)
    if ROUND:  # one row: this program's values read back as stored, rounded per group
        tl.debug_barrier()
        round_groups(Out, Q, S, OFF, tl.program_id(1) * (BLOCK // 32), n_cols // 32, BLOCK // 32)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shape tensors whose last dimension is contiguous."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if not use_triton(gate):
        return silu_mul_ref(gate, up)
    return _launch(gate, up, None)


def silu_mul_int8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, Int8Row]:
    """(silu(gate) * up, that rounded to int8) for one row [1, I], I a multiple of 32, on a
    Triton device: one launch where `silu_mul` and `quantize_x_int8` would take two."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.shape[0] != 1 or gate.shape[1] % 32:
        raise ValueError(
            f"silu_mul_int8 takes one row of a multiple of 32 values for gate and up, got "
            f"{tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if not use_triton(gate):
        raise ValueError("silu_mul_int8 runs on a CUDA device (or Triton's interpreter)")
    rounded = Int8Row.empty(gate.shape[1], gate.device)
    return _launch(gate, up, rounded), rounded


def _launch(gate: torch.Tensor, up: torch.Tensor, rounded: Int8Row | None) -> torch.Tensor:
    shape = gate.shape
    g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    n_rows, n_cols = g2.shape
    arrays = (rounded.q, rounded.scales, rounded.offsets) if rounded is not None else (out, out, out)
    if n_rows and n_cols:
        _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, _BLOCK))](
            g2,
            u2,
            out,
            *arrays,
            g2.stride(0),
            u2.stride(0),
            out.stride(0),
            n_cols,
            ROUND=rounded is not None,
            BLOCK=_BLOCK,
            num_warps=4,
            enable_fp_fusion=rounded is None,  # the rounding is torch's only without contraction
            **pdl_args(g2, "silu_mul"),
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
