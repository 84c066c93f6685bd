"""One row of x times a GGUF weight (`quant_gemv.GpuBlocks`: Q4_0, Q4_1, Q4_K, Q8_0) with x rounded
to int8 once per call by its own small kernel, as llama.cpp rounds its q8_1 activations, but with
"dp4a"'s groups: one scale (max|x| / 127) per eight values a weight word meets (values 4t..4t+3
and 16+4t..19+4t of a block; one per 32 measured worse on the default model), and per block the
scaled integer sum its offset term needs. The matmul kernel reads x's int8 words beside the
weight's, each weight word meets them in `dp4a`, and a thread holds whole blocks, so nothing
crosses threads in the loop. Promises: `gemv_int8x` equals the exact matmul of
`quant_gemv_dp4a.quantize_x_ref(x)` with the dequantized weight to fp32 rounding, and
`quantize_x_int8`'s values times their scales equal that rounding exactly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import interpreting, pdl_args, pdl_wait, tl, triton
from .quant_gemv_dp4a import FORMAT_KIND, word_dot

INT8X_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
_QUANT_BLOCKS = 16  # x blocks per program of the rounding kernel


@dataclass(frozen=True)
class Int8Row:
    """x [1, K] as the matmul kernel reads it: q int8 [K] (x / scale, rounded); scales fp32
    [K / 32, 4], the scale of group t of each block (values 4t..4t+3 and 16+4t..19+4t); offsets
    fp32 [K / 32], each block's sum over its groups of scale times the group's integer sum."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    @staticmethod
    def empty(k: int, device: torch.device) -> Int8Row:
        """Room for a row of k values (k a multiple of 32); `round_groups` fills it."""
        if k % 32:
            raise ValueError(f"an int8 row holds whole blocks of 32 values, got {k}")
        return Int8Row(
            torch.empty(k, dtype=torch.int8, device=device),
            torch.empty(k // 32, 4, dtype=torch.float32, device=device),
            torch.empty(k // 32, dtype=torch.float32, device=device),
        )


@triton.jit
def round_groups(X, Q, S, OFF, blk0, NB, BLOCKS: tl.constexpr):
    """Blocks blk0 .. blk0 + BLOCKS - 1 (those below NB) of the row at X, rounded into an
    `Int8Row`'s arrays Q, S, OFF. Launch with fp fusion off: IEEE division and no multiply-add
    contraction make the rounding torch's (`quantize_x_ref`), bit for bit."""
    grp = blk0 * 4 + tl.arange(0, BLOCKS * 4)  # block grp // 4, group grp % 4
    ok = grp < NB * 4
    at = ((grp // 4) * 32 + (grp % 4) * 4)[:, None, None] + tl.arange(0, 2)[None, :, None] * 16
    at += tl.arange(0, 4)[None, None, :]
    v = tl.load(X + at, mask=ok[:, None, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(v), axis=2), axis=1)
    inv = tl.where(amax > 0, tl.math.div_rn(127.0, amax), 0.0)
    q = tl.floor(v * inv[:, None, None] + 0.5).to(tl.int32)
    tl.store(Q + at, q.to(tl.int8), mask=ok[:, None, None])
    scale = tl.math.div_rn(amax, 127.0)
    tl.store(S + grp, scale, mask=ok)
    part = tl.reshape(tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32) * scale, (BLOCKS, 4))
    blk = blk0 + tl.arange(0, BLOCKS)
    tl.store(OFF + blk, tl.sum(part, axis=1), mask=blk < NB)


@triton.jit
def _quantize_x_kernel(X, Q, S, OFF, NB, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    round_groups(X, Q, S, OFF, tl.program_id(0) * BLOCKS, NB, BLOCKS)


@triton.jit
def weight_tile(
    QW,
    D,
    MN,
    g,
    b0,
    N,
    NB,
    KIND: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_B: tl.constexpr,
):
    """Row group g's blocks b0 .. b0 + BLOCK_B - 1: weight words (qa; qb: a Q8 block's second
    half), scales d and (Q4_1, Q4_K) offsets m, both zero past the last block."""
    WB: tl.constexpr = 8 if KIND == 2 else 4
    rows = tl.minimum(g * ROWS + tl.arange(0, ROWS), N - 1).to(tl.int64)  # past N: re-read N-1
    bb = b0 + tl.arange(0, BLOCK_B)
    blk = bb if EVEN_B else tl.minimum(bb, NB - 1)
    words = QW + rows[:, None, None] * (NB * WB) + blk[None, :, None] * WB + tl.arange(0, 4)[None, None, :]
    qa = tl.load(words)
    qb = qa
    if KIND == 2:
        qb = tl.load(words + 4)
    d = tl.load(D + rows[:, None] * NB + blk[None, :]).to(tl.float32)
    if not EVEN_B:
        d = tl.where((bb < NB)[None, :], d, 0.0)
    m = d
    if KIND == 1:
        m = tl.load(MN + rows[:, None] * NB + blk[None, :]).to(tl.float32)
        if not EVEN_B:
            m = tl.where((bb < NB)[None, :], m, 0.0)
    return qa, qb, d, m


@triton.jit
def x_tile(
    XQ, XS, XO, b0, NB, KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr
):
    """x's int8 words (values 4t..4t+3, then 16+4t..19+4t), group scales and block offsets for
    blocks b0 .. b0 + BLOCK_B - 1, shaped per row of the tile (a zero row stride) so they take
    the weight tile's layout."""
    bb = b0 + tl.arange(0, BLOCK_B)
    blk = bb if EVEN_B else tl.minimum(bb, NB - 1)
    same = tl.zeros((ROWS,), dtype=tl.int32)
    t = tl.arange(0, 4)[None, None, :]
    at = XQ + same[:, None, None] + blk[None, :, None] * 8 + t
    scales = tl.load(XS + same[:, None, None] + blk[None, :, None] * 4 + t)
    offsets = tl.zeros((ROWS, BLOCK_B), dtype=tl.float32)  # Q8_0 has no offset term
    if KIND != 2:
        offsets = tl.load(XO + same[:, None] + blk[None, :])
    return tl.load(at), tl.load(at + 4), scales, offsets


@triton.jit
def int8_tile_dot(qa, qb, d, m, xa, xb, xs, xo, KIND: tl.constexpr, ASM: tl.constexpr):
    """[ROWS, BB] partial products of a weight tile (words qa, qb as `word_dot` takes them, block
    scales d and offsets m) with x's int8 words xa, xb, group scales xs and block offsets xo."""
    isum = word_dot(qa, qb, xa, xb, KIND, ASM).to(tl.float32)
    dot = tl.sum(isum * xs, axis=2)
    if KIND == 2:
        return d * dot
    if KIND == 0:  # Q4_0 values are q - 8
        return d * (dot - 8.0 * xo)
    return d * dot + m * xo


@triton.jit
def _gemv_int8x_kernel(
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
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS weight rows per program over [ROWS, BLOCK_B, 4] word tiles. x's words, scales and
    offsets are addressed per row too (a zero row stride): Triton then lays them out as the weight
    tile is, so no shared-memory exchange or barrier enters the loop; the repeated reads hit L1."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_B), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        qa, qb, d, m = weight_tile(QW, D, MN, tl.program_id(0), b0, N, NB, KIND, ROWS, BLOCK_B, EVEN_B)
        xa, xb, xs, xo = x_tile(XQ, XS, XO, b0, NB, KIND, ROWS, BLOCK_B, EVEN_B)
        acc += int8_tile_dot(qa, qb, d, m, xa, xb, xs, xo, KIND, ASM)
    y = tl.sum(acc, axis=1)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=offs < N)


def quantize_x_int8(x: torch.Tensor) -> Int8Row:
    """x [1, K] (K a multiple of 32, any float dtype) rounded as `quant_gemv_dp4a.quantize_x_ref`
    rounds it."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] % 32:
        raise ValueError(f"quantize_x_int8 takes one row of a multiple of 32 values, got {tuple(x.shape)}")
    x = x.contiguous()
    nb = x.shape[1] // 32
    out = Int8Row.empty(x.shape[1], x.device)
    _quantize_x_kernel[(triton.cdiv(nb, _QUANT_BLOCKS),)](
        x,
        out.q,
        out.scales,
        out.offsets,
        nb,
        BLOCKS=_QUANT_BLOCKS,
        enable_fp_fusion=False,
        **pdl_args(x, "quantize_x"),
    )
    return out


@dataclass(frozen=True)
class Int8Launch:
    """What the int8-row matmul kernels ("int8x", "stream") are launched with: their pointer and
    size arguments (x's arrays, the weight's, y, N, NB), the constexprs and launch options they
    share, and y."""

    args: tuple[torch.Tensor | int, ...]
    consts: dict[str, int | bool]
    y: torch.Tensor
    n: int
    nb: int
    block_b: int


def int8_launch(
    name: str,
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    qtype: str,
    rows: int,
    block_b: int,
    x_int8: Int8Row | None,
) -> Int8Launch:
    """Checks name's arguments, rounds x unless x_int8 is x already rounded, and lays out the
    launch: y [1, N] in x's dtype, the tile's blocks at most K's."""
    if qtype not in INT8X_FORMATS:
        raise ValueError(f"{name} serves {', '.join(INT8X_FORMATS)}, got {qtype}")
    if rows < 1 or rows & (rows - 1) or rows > 64:
        raise ValueError(f"{name} takes a power of two up to 64 rows per tile, got {rows}")
    xq = quantize_x_int8(x) if x_int8 is None else x_int8
    n, nb = qs.shape[0], x.shape[1] // 32
    if xq.q.numel() != x.shape[1]:
        raise ValueError(f"x_int8 holds {xq.q.numel()} values for a row of {x.shape[1]}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_b = min(block_b, triton.next_power_of_2(nb))
    args = (xq.q.view(torch.int32), xq.scales, xq.offsets, qs.view(torch.int32), d, m if m is not None else d)
    consts: dict[str, int | bool] = dict(
        KIND=FORMAT_KIND[qtype],
        ROWS=rows,
        BLOCK_B=block_b,
        EVEN_B=nb % block_b == 0,
        ASM=not interpreting(),
        **pdl_args(x, name),
    )
    return Int8Launch((*args, y, n, nb), consts, y, n, nb, block_b)


def gemv_int8x(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    qtype: str,
    rows: int,
    block_b: int,
    num_warps: int,
    num_stages: int = 1,
    x_int8: Int8Row | None = None,
) -> torch.Tensor:
    """y [1, N] in x's dtype for x [1, K] (bf16, fp16 or fp32) and one `GpuBlocks`' arrays: two
    launches, x's rounding and the matmul, or the matmul alone where x_int8 is x already rounded
    (by `quantize_x_int8`, or fused into the op that wrote x); rows per program a power of two up
    to 64."""
    launch = int8_launch("gemv_int8x", x, qs, d, m, qtype, rows, block_b, x_int8)
    grid = (triton.cdiv(launch.n, rows),)
    _gemv_int8x_kernel[grid](
        *launch.args, **launch.consts, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True
    )
    return launch.y


__all__ = [
    "INT8X_FORMATS",
    "Int8Launch",
    "Int8Row",
    "gemv_int8x",
    "int8_launch",
    "int8_tile_dot",
    "quantize_x_int8",
    "round_groups",
    "weight_tile",
    "x_tile",
]
