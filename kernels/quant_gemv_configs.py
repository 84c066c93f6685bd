"""Which kernel `quant_gemv.quant_matmul` runs: the kinds and their tile sizes (`QuantMatmulConfig`),
the default per row count, and for one 16-bit row the packed kind per format and weight size.
Promises: every config here is one `quant_matmul` accepts for the rows and formats
`choose_config` gives it to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .quant_gemv_stream import MAX_STAGES


class BlockShape(Protocol):
    """What the choice reads of a weight (`quant_gemv.GpuBlocks`)."""

    @property
    def qtype(self) -> str: ...

    @property
    def cols(self) -> int: ...

    @property
    def rows(self) -> int: ...


KINDS = ("acc", "fma", "dot", "half2", "dp4a", "int8x", "stream")


@dataclass(frozen=True)
class QuantMatmulConfig:
    """kind "acc": one row of x, products summed elementwise and reduced once at the end; "fma":
    each program owns block_n weight rows and streams them over K, a static loop over x's rows
    (M <= 8); "dot": block_m x block_n tiles, weights dequantized per K tile into tensor-core
    dots; "half2": one bf16/fp16 row of a Q4 format, block_n rows per program (a power of two
    up to 32); "dp4a": one bf16/fp16 row of any format here, x rounded to int8 and integer dot
    products (`quant_gemv_dp4a`), block_n rows per program; "int8x": x rounded alike but once per
    call, by a launch before the matmul's (`quant_gemv_int8x`); "stream": x rounded alike, by
    programs_per_sm persistent programs per multiprocessor walking tiles of block_n rows x block_k
    values, num_stages of them in flight (`quant_gemv_stream`). block_k counts values (a multiple
    of 32); magic: quants become floats by exponent bits instead of int-to-float conversions."""

    kind: str = "fma"
    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4
    block_m: int = 16
    num_stages: int = 1
    magic: bool = False
    programs_per_sm: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quant_matmul kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.block_k < 32 or self.block_k & (self.block_k - 1):
            raise ValueError(f"quant_matmul block_k must be a power of two >= 32, got {self.block_k}")
        if (self.kind == "stream") != (self.programs_per_sm > 0):
            raise ValueError(
                f"programs_per_sm >= 1 is for kind 'stream' alone, got {self.programs_per_sm} for {self.kind!r}"
            )
        if self.kind == "stream" and not 1 <= self.num_stages <= MAX_STAGES:
            raise ValueError(f"kind 'stream' pipelines 1 to {MAX_STAGES} stages, got {self.num_stages}")

    def label(self) -> str:
        persistent = f" p{self.programs_per_sm}" if self.programs_per_sm else ""
        return (
            f"{self.kind} m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} "
            f"s{self.num_stages}{persistent}{' magic' if self.magic else ''}"
        )


FMA_MAX_M = 8
# per row count (the smallest key >= M applies; larger M take DOT): CUDA cores while the FMAs
# per weight byte are few, tensor cores above. benchmarks/quant_gpu.py measures the choices.
DEFAULTS: dict[int, QuantMatmulConfig] = {
    1: QuantMatmulConfig("acc", 2, 2048, 4),
    2: QuantMatmulConfig("fma", 2, 2048, 4),
    8: QuantMatmulConfig("dot", 64, 128, 4, 16, 3),
    16: QuantMatmulConfig("dot", 32, 128, 4, 16, 3),
    128: QuantMatmulConfig("dot", 64, 128, 4, 64, 4),
}
DOT = QuantMatmulConfig("dot", 128, 64, 8, 128, 3)
HALF2 = QuantMatmulConfig("half2", 16, 2048, 4)
DP4A = QuantMatmulConfig("dp4a", 4, 1024, 4, num_stages=1)
# rows of K >= LONG_K (the MLP's down projection) are few for their length; they measured faster
# with longer K tiles, pipelined (benchmarks/quant_gpu.py picks both from its sweep)
DP4A_LONG_K = QuantMatmulConfig("dp4a", 4, 2048, 4, num_stages=3)
# one block of 32 values per thread (4 rows x 32 blocks over 4 warps): no barrier in the loop
INT8X = QuantMatmulConfig("int8x", 4, 1024, 4, num_stages=1)
INT8X_LONG_K = QuantMatmulConfig("int8x", 4, 1024, 4, num_stages=1)  # INT8X's tiles
LONG_K = 8192
# a one-row kind's config for rows of K >= LONG_K
LONG_K_CONFIG: dict[QuantMatmulConfig, QuantMatmulConfig] = {DP4A: DP4A_LONG_K, INT8X: INT8X_LONG_K}


def default_config(m: int) -> QuantMatmulConfig:
    return next((DEFAULTS[k] for k in sorted(DEFAULTS) if k >= m), DOT)


# one 16-bit row: the packed kind per format, from benchmarks/quant_gpu.py's per-layer sums
# (dp4a beat half2 on every Q4 shape and acc on Q8_0)
ONE_ROW: dict[str, QuantMatmulConfig] = {"Q4_0": DP4A, "Q4_1": DP4A, "Q4_K": DP4A, "Q8_0": DP4A}


# one 16-bit row of a weight of at least LARGE_WEIGHT values (an 8B model's MLP, not its attention):
# the packed config per format where it differs from ONE_ROW's. One weight row per one-warp
# program, x rounded by the norm or SiLU-and-mul that writes it, measured faster than dp4a's on
# the MLP shapes, Q4_0 and Q4_1 (benchmarks/results/one_row_rows_sass.md); on qkv and o dp4a
# stays faster.
LARGE_WEIGHT = 1 << 25
INT8X_ONE_ROW = QuantMatmulConfig("int8x", 1, 1024, 1, num_stages=1)
ONE_ROW_LARGE: dict[str, QuantMatmulConfig] = {"Q4_0": INT8X_ONE_ROW, "Q4_1": INT8X_ONE_ROW}


def choose_config(x: torch.Tensor, w: BlockShape) -> QuantMatmulConfig:
    """The config `quant_matmul` runs without one: for one 16-bit row of a format ONE_ROW lists,
    ONE_ROW_LARGE's for a large weight where it has one, else ONE_ROW's, either one's
    LONG_K_CONFIG entry for long rows; else the row count's default."""
    cfg = ONE_ROW.get(w.qtype)
    if cfg is None or x.shape[0] != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        return default_config(x.shape[0])
    if w.rows * w.cols >= LARGE_WEIGHT and w.qtype in ONE_ROW_LARGE:
        cfg = ONE_ROW_LARGE[w.qtype]
    return LONG_K_CONFIG.get(cfg, cfg) if w.cols >= LONG_K else cfg
