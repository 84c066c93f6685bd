"""GGUF weights as the GPU kernels read them: `repack` turns ggml's block bytes (Q4_0 / Q4_1 / Q8_0 /
Q4_K) into separate arrays of quants, fp16 scales and offsets (`GpuBlocks`) once at load, so the
matmul kernels read each with wide loads. Promises: `dequantize(repack(raw, t))` equals
`quant_blocks.dequantize_blocks(raw, t)` (itself equal to gguf's dequantization)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant_blocks import BLOCKS, affine_terms

GEMV_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")


@dataclass(frozen=True)
class GpuBlocks:
    """A [rows, cols] GGUF weight as arrays: qs uint8 [rows, cols / 2] (Q4: block b's 16 bytes at
    16b, low nibbles values 0-15, high 16-31) or [rows, cols] (Q8_0: the int8 values' bytes);
    d fp16 [rows, cols / 32]; m fp16 [rows, cols / 32] for Q4_1 (the block's minimum), else None.
    Q4_K keeps that Q4 layout per 32 values with fp32 d (super-block scale x 6-bit sub-scale) and
    m (-dmin x 6-bit sub-min), the products its own dequantization forms."""

    qtype: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    cols: int

    @property
    def rows(self) -> int:
        return self.qs.shape[0]


def repack(raw: torch.Tensor, qtype: str) -> GpuBlocks:
    """raw uint8 [rows, blocks * bytes] (ggml's layout) → GpuBlocks on raw's device."""
    if qtype not in GEMV_FORMATS:
        raise ValueError(f"quant_matmul serves {', '.join(GEMV_FORMATS)}, got {qtype}")
    nbytes, _ = BLOCKS[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"{qtype} raw must be uint8 [rows, blocks * {nbytes}], got {tuple(raw.shape)}")
    rows, nb = raw.shape[0], raw.shape[1] // nbytes
    if qtype == "Q4_K":  # d * sub-scale and -dmin * sub-min per 32 values, the nibbles re-paired
        g = affine_terms(raw, qtype)[0]
        q = g.q.reshape(rows, -1, 32)
        qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(rows, -1)
        return GpuBlocks(qtype, qs.contiguous(), g.scale.contiguous(), g.offset.contiguous(), g.q.shape[1])
    b = raw.reshape(rows, nb, nbytes)
    halves = b[..., :4].contiguous().view(torch.float16)  # [rows, nb, 2]: d, then Q4_1's m
    head = 4 if qtype == "Q4_1" else 2
    qs = b[..., head:].contiguous().reshape(rows, -1)
    m = halves[..., 1].contiguous() if qtype == "Q4_1" else None
    return GpuBlocks(qtype, qs, halves[..., 0].contiguous(), m, nb * 32)


def dequantize(w: GpuBlocks) -> torch.Tensor:
    """float32 [rows, cols] from the repacked arrays, equal to `dequantize_blocks` of the raw."""
    rows, nb = w.rows, w.cols // 32
    d = w.d.float().reshape(rows, nb, 1)
    if w.qtype == "Q8_0":
        return (d * w.qs.view(torch.int8).float().reshape(rows, nb, 32)).reshape(rows, -1)
    qb = w.qs.reshape(rows, nb, 16)
    q = torch.cat([qb & 0x0F, qb >> 4], dim=-1).float()
    if w.qtype == "Q4_0":
        return (d * q + (-8 * d)).reshape(rows, -1)
    assert w.m is not None
    return (d * q + w.m.float().reshape(rows, nb, 1)).reshape(rows, -1)
