"""QuantTensor: a weight kept as its GGUF blocks (uint8, one row of blocks per output row) with
its format name; rows can be stacked (fused q/k/v, gate/up) and gathered (embedding lookups)
without touching the blocks. The block layouts themselves live in radixlm.kernels.quant_blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.quant_blocks import AFFINE_FORMATS, BLOCKS, AffineGroups, affine_terms, dequantize_blocks

__all__ = ["AFFINE_FORMATS", "BLOCKS", "AffineGroups", "QuantTensor", "stack_rows"]


@dataclass
class QuantTensor:
    """A [rows, cols] weight as GGUF blocks: raw is uint8 [rows, cols // values * bytes]."""

    qtype: str
    raw: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCKS:
            raise ValueError(f"GGUF type {self.qtype} is not supported (supported: {', '.join(BLOCKS)})")
        nbytes, nvalues = BLOCKS[self.qtype]
        if self.cols % nvalues or self.raw.shape[-1] != self.cols // nvalues * nbytes:
            raise ValueError(
                f"{self.qtype} rows of {self.cols} values need {self.cols // nvalues * nbytes} bytes"
            )

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def select_rows(self, index: torch.Tensor) -> QuantTensor:
        return QuantTensor(self.qtype, self.raw[index], self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], equal to gguf.quants.dequantize of the same blocks."""
        return dequantize_blocks(self.raw, self.qtype)

    def affine_terms(self) -> list[AffineGroups]:
        return affine_terms(self.raw, self.qtype)


def stack_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Parts of one format stacked along rows (fused q/k/v, gate/up): rows are independent."""
    if len({p.qtype for p in parts}) != 1 or len({p.cols for p in parts}) != 1:
        raise ValueError("stack_rows needs parts of one format and width")
    return QuantTensor(parts[0].qtype, torch.cat([p.raw for p in parts]), parts[0].cols)
