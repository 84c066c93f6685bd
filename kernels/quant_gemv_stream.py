"""One row of x (already rounded to int8, `quant_gemv_int8x.Int8Row`) times a GGUF weight, by
persistent programs that stream their weight rows: a program owns every G-th group of rows and walks
its (row group, K tile) pairs in one loop that Triton software-pipelines (STAGES tiles in flight
through asynchronous copies to shared memory, not registers), so each resident warp keeps weight
bytes in flight across row ends, and program starts cost nothing after the first. Promises:
`gemv_stream` equals `gemv_int8x` (the same integer dots and scales, summed in another order) to
fp32 rounding."""

from __future__ import annotations

import torch

from ._triton import pdl_wait, tl, triton
from .quant_gemv_int8x import Int8Row, int8_launch, int8_tile_dot, weight_tile, x_tile

MAX_STAGES = 8  # the deepest pipeline a config may ask for; at 1 each tile is loaded when its turn comes


@triton.jit
def _gemv_stream_kernel(
    XQ,
    XS,
    XO,
    QW,
    D,
    MN,
    Y,
    N,
    NB,
    KIND: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_B: tl.constexpr,
    X_WHOLE: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program pid's groups of ROWS rows are pid, pid + G, ... (G programs), each walked over its
    K tiles, (g, b0) the tile at hand. X_WHOLE (one tile spans K): x is read once, before the
    loop."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    groups = tl.cdiv(N, ROWS)
    total = tl.cdiv(groups - pid, progs) * tl.cdiv(NB, BLOCK_B)
    g = pid
    b0 = 0
    if X_WHOLE:
        xa, xb, xs, xo = x_tile(XQ, XS, XO, 0, NB, KIND, ROWS, BLOCK_B, EVEN_B)
    acc = tl.zeros((ROWS, BLOCK_B), dtype=tl.float32)
    for _ in tl.range(0, total, num_stages=STAGES):
        qa, qb, d, m = weight_tile(QW, D, MN, g, b0, N, NB, KIND, ROWS, BLOCK_B, EVEN_B)
        if not X_WHOLE:
            xa, xb, xs, xo = x_tile(XQ, XS, XO, b0, NB, KIND, ROWS, BLOCK_B, EVEN_B)
        acc += int8_tile_dot(qa, qb, d, m, xa, xb, xs, xo, KIND, ASM)
        row_end = b0 + BLOCK_B >= NB
        if row_end:
            offs = g * ROWS + tl.arange(0, ROWS)
            tl.store(Y + offs, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=offs < N)
            acc = tl.zeros((ROWS, BLOCK_B), dtype=tl.float32)
        g = tl.where(row_end, g + progs, g)
        b0 = tl.where(row_end, 0, b0 + BLOCK_B)


_SMS: dict[int, int] = {}


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (4 where the interpreter runs on the CPU)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def stream_programs(groups: int, sms: int, programs_per_sm: int) -> int:
    """Programs for `groups` row groups: at most programs_per_sm per multiprocessor, each given
    the same number of groups (the last ones one fewer at most)."""
    per = triton.cdiv(groups, max(1, sms * programs_per_sm))
    return triton.cdiv(groups, per)


def gemv_stream(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    qtype: str,
    rows: int,
    block_b: int,
    num_warps: int,
    stages: int,
    programs_per_sm: int,
    x_int8: Int8Row | None = None,
) -> torch.Tensor:
    """y [1, N] in x's dtype for x [1, K] and one `GpuBlocks`' arrays, x rounded here or given
    rounded (x_int8); rows per tile a power of two up to 64, 1 to MAX_STAGES stages."""
    if not 1 <= stages <= MAX_STAGES:
        raise ValueError(f"gemv_stream pipelines 1 to {MAX_STAGES} stages, got {stages}")
    if programs_per_sm < 1:
        raise ValueError(f"gemv_stream needs at least one program per multiprocessor, got {programs_per_sm}")
    launch = int8_launch("gemv_stream", x, qs, d, m, qtype, rows, block_b, x_int8)
    grid = stream_programs(triton.cdiv(launch.n, rows), multiprocessors(x.device), programs_per_sm)
    whole = launch.block_b >= launch.nb
    _gemv_stream_kernel[(grid,)](
        *launch.args,
        **launch.consts,
        X_WHOLE=whole,
        STAGES=stages,
        num_warps=num_warps,
        enable_fp_fusion=True,
    )
    return launch.y


__all__ = ["MAX_STAGES", "gemv_stream", "multiprocessors", "stream_programs"]
