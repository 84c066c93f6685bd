"""One row of x times a GGUF weight (`quant_gemv.GpuBlocks`: Q4_0, Q4_1, Q4_K, Q8_0) in integer
arithmetic: each program quantizes x to int8 in groups of eight values (scale max|x| / 127, as
llama.cpp's q8_1 activations do per 32), and a word of weight quants meets a word of x in one
`dp4a` (four int8 products summed in int32); scales and offsets apply once per word and block.
Promises: `gemv_dp4a` equals the exact matmul of `quantize_x_ref(x)` with the dequantized
weight to fp32 rounding, and so the matmul with x itself to x's int8 rounding (about 0.5%
relative on random x)."""

from __future__ import annotations

import torch

from ._triton import pdl_wait, tl, triton
from .quant_gemv_half2 import aligned_row, fp16_bits_to_f32, launch_one_row

DP4A_FORMATS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
# the GGUF matmul kernels' KIND per format: Q4 nibbles without (0) or with (1) a per-block
# minimum (Q4_K's sub-blocks of 32 are Q4_1's affine form once repacked), Q8 bytes (2)
FORMAT_KIND = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 1, "Q8_0": 2}

# a weight word's nibbles as unsigned bytes against two words of x: low nibbles meet values 4t..4t+3
# of the block, high nibbles values 16+4t..19+4t
_DOT_Q4 = tl.constexpr("""{
.reg .b32 lo, hi, acc;
and.b32 lo, $1, 0x0f0f0f0f;
shr.u32 hi, $1, 4;
and.b32 hi, hi, 0x0f0f0f0f;
dp4a.u32.s32 acc, lo, $2, 0;
dp4a.u32.s32 $0, hi, $3, acc;
}""")
# two words of int8 weights against the two words of x at the same values
_DOT_Q8 = tl.constexpr("""{
.reg .b32 acc;
dp4a.s32.s32 acc, $1, $3, 0;
dp4a.s32.s32 $0, $2, $4, acc;
}""")


@triton.jit
def _signed_byte(w, k: tl.constexpr):
    return (w << (24 - 8 * k)) >> 24


@triton.jit
def _dot4(a, b, A_SIGNED: tl.constexpr):
    """Σ_k byte_k(a) · signed byte_k(b) (interpreter path of dp4a)."""
    total = tl.zeros_like(a)
    for k in tl.static_range(4):
        ak = _signed_byte(a, k) if A_SIGNED else (a >> (8 * k)) & 0xFF
        total += ak * _signed_byte(b, k)
    return total


@triton.jit
def word_dot(qa, qb, xa, xb, KIND: tl.constexpr, ASM: tl.constexpr):
    """int32 Σ of the products of one Q4 word (qa; qb unused) or two Q8 words (qa, qb) with the
    x words xa (values 4t..4t+3) and xb (16+4t..19+4t)."""
    if KIND == 2:
        if ASM:
            return tl.inline_asm_elementwise(
                _DOT_Q8, "=r,r,r,r,r", [qa, qb, xa, xb], dtype=tl.int32, is_pure=True, pack=1
            )
        return _dot4(qa, xa, True) + _dot4(qb, xb, True)
    if ASM:
        return tl.inline_asm_elementwise(
            _DOT_Q4, "=r,r,r,r", [qa, xa, xb], dtype=tl.int32, is_pure=True, pack=1
        )
    return _dot4(qa & 0x0F0F0F0F, xa, False) + _dot4((qa >> 4) & 0x0F0F0F0F, xb, False)


@triton.jit
def _round(v):
    return tl.floor(v + 0.5).to(tl.int32)


@triton.jit
def _x_values(g, X_F16: tl.constexpr):
    """Four bf16 or fp16 values packed in an int64 as float32, lowest first."""
    lo = g.to(tl.int32)
    hi = (g >> 32).to(tl.int32)
    if X_F16:
        return (
            fp16_bits_to_f32(lo),
            fp16_bits_to_f32(lo >> 16),
            fp16_bits_to_f32(hi),
            fp16_bits_to_f32(hi >> 16),
        )
    return (
        (lo << 16).to(tl.float32, bitcast=True),
        (lo & -65536).to(tl.float32, bitcast=True),
        (hi << 16).to(tl.float32, bitcast=True),
        (hi & -65536).to(tl.float32, bitcast=True),
    )


@triton.jit
def _abs_max4(v0, v1, v2, v3):
    return tl.maximum(tl.maximum(tl.abs(v0), tl.abs(v1)), tl.maximum(tl.abs(v2), tl.abs(v3)))


@triton.jit
def _x_word(v0, v1, v2, v3, inv):
    """Four values times inv, rounded, as one word of int8 (v0 in the low byte), and their sum."""
    q0 = _round(v0 * inv)
    q1 = _round(v1 * inv)
    q2 = _round(v2 * inv)
    q3 = _round(v3 * inv)
    word = (q0 & 0xFF) | ((q1 & 0xFF) << 8) | ((q2 & 0xFF) << 16) | (q3 << 24)
    return word, q0 + q1 + q2 + q3


@triton.jit
def _quantize_x(ga, gb, X_F16: tl.constexpr):
    """The eight values of x a weight word meets (ga: values 4t..4t+3, gb: 16+4t..19+4t, four
    16-bit values per int64) as two int8 words xa, xb with one scale dx and their integer sum
    sx (float32): a scale per word, not per block, so no value crosses threads."""
    a0, a1, a2, a3 = _x_values(ga, X_F16)
    b0, b1, b2, b3 = _x_values(gb, X_F16)
    amax = tl.maximum(_abs_max4(a0, a1, a2, a3), _abs_max4(b0, b1, b2, b3))
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    xa, sa = _x_word(a0, a1, a2, a3, inv)
    xb, sb = _x_word(b0, b1, b2, b3, inv)
    return xa, xb, amax / 127.0, (sa + sb).to(tl.float32)


@triton.jit
def dp4a_rows(
    X4,
    QW,
    D,
    MN,
    rows,
    NB,
    KIND: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    EVEN_B: tl.constexpr,
    X_F16: tl.constexpr,
    ASM: tl.constexpr,
):
    """y [ROWS] fp32: weight rows `rows` (int64, each < N) times x, over [ROWS, BLOCK_B, 4] word
    tiles; x is quantized once per tile of blocks and its words reused for every row."""
    WB: tl.constexpr = 8 if KIND == 2 else 4  # words per block of 32 quants
    bb = tl.arange(0, BLOCK_B)
    t = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((ROWS, BLOCK_B), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        valid = (b0 + bb) < NB
        blk = b0 + bb if EVEN_B else tl.minimum(b0 + bb, NB - 1)
        x_at = X4 + blk[None, :, None] * 8 + t  # [1, BB, 4] groups of four values
        xa, xb, dx, sx = _quantize_x(tl.load(x_at), tl.load(x_at + 4), X_F16)
        words = QW + rows[:, None, None] * (NB * WB) + blk[None, :, None] * WB + t
        qa = tl.load(words)
        qb = qa
        if KIND == 2:
            qb = tl.load(words + 4)
        dots = word_dot(qa, qb, xa, xb, KIND, ASM).to(tl.float32)  # [ROWS, BB, 4]
        if KIND == 0:
            dots -= 8.0 * sx
        d = tl.load(D + rows[:, None] * NB + blk[None, :]).to(tl.float32)
        if not EVEN_B:
            d = tl.where(valid[None, :], d, 0.0)
        acc += tl.sum(dots * dx, axis=2) * d
        if KIND == 1:
            m = tl.load(MN + rows[:, None] * NB + blk[None, :]).to(tl.float32)
            if not EVEN_B:
                m = tl.where(valid[None, :], m, 0.0)
            acc += m * tl.sum(sx * dx, axis=2)
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_dp4a_kernel(
    X4,
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
    X_F16: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS consecutive weight rows per program."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rows = tl.minimum(offs, N - 1).to(tl.int64)  # rows past N re-read N-1, never stored
    y = dp4a_rows(X4, QW, D, MN, rows, NB, KIND, ROWS, BLOCK_B, EVEN_B, X_F16, ASM)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=offs < N)


def gemv_dp4a(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    qtype: str,
    rows: int,
    block_b: int,
    num_warps: int,
    num_stages: int = 1,
) -> torch.Tensor:
    """y [1, N] for x [1, K] and one `GpuBlocks`' arrays; rows per program a power of two."""
    if qtype not in DP4A_FORMATS:
        raise ValueError(f"gemv_dp4a serves {', '.join(DP4A_FORMATS)}, got {qtype}")
    if rows < 1 or rows & (rows - 1) or rows > 64:
        raise ValueError(f"gemv_dp4a takes a power of two up to 64 rows per program, got {rows}")
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv_dp4a takes one row of x, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv_dp4a takes a bf16 or fp16 row of x, got {x.dtype}")
    x = aligned_row(x, 8)  # read as groups of four values
    return launch_one_row(
        _gemv_dp4a_kernel,
        x,
        x.view(torch.int64),
        qs,
        d,
        m,
        FORMAT_KIND[qtype],
        rows,
        block_b,
        num_warps,
        num_stages,
    )


def quantize_x_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel sees it: in each block of 32, the eight values 4t..4t+3 and
    16+4t..19+4t (t < 4) share a scale max|x| / 127 and are rounded to floor(x / scale + 0.5),
    in float32 with IEEE division on any device. `gemv_dp4a` equals the exact matmul of this with
    the dequantized weight."""
    xg = x.float().reshape(x.shape[0], -1, 2, 4, 4)  # [M, block, half, t, value]
    amax = xg.abs().amax(dim=(2, 4), keepdim=True)
    # Tensor by tensor: torch turns `127.0 / t` into 127 * (1 / t) everywhere, and `t / 127.0` on
    # CUDA into t * (1 / 127), each one rounding more than the kernels' division.
    c127 = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    return (torch.floor(xg * inv + 0.5) * (amax / c127)).reshape(x.shape)


__all__ = ["DP4A_FORMATS", "FORMAT_KIND", "dp4a_rows", "gemv_dp4a", "quantize_x_ref", "word_dot"]
