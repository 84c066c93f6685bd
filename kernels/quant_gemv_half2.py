"""One row of x times a Q4_0 / Q4_1 / Q4_K weight (`quant_gemv.GpuBlocks`) with packed half
arithmetic: each 32-bit word of quants becomes four f16x2 pairs by byte permutes and bit masks
(no int-to-float conversions), and its eight products take four f16x2 multiply-adds; x's pairs
are converted once per program and reused over all its weight rows. Promises: `gemv_half2`
equals the fp32 matmul with the dequantized weight to fp16 rounding, for |x| < 16384 (x is
scaled by 1/16 in fp16, so a lane's four products, |q| <= 15, cannot overflow)."""

from __future__ import annotations

from typing import Any

import torch

from ._triton import interpreting, pdl_args, pdl_wait, tl, triton

HALF2_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
# 1024 + v from the fp16 bit pattern 0x6400 | v; minus 8 for Q4_0's signed quants
_LOW_BIAS = {0: "0x64086408", 1: "0x64006400"}
# (1024 + 16 v) / 16 - 64, minus 8 for Q4_0: -72.0 or -64.0 in fp16 pairs
_HIGH_BIAS = {0: "0xd480d480", 1: "0xd400d400"}
_SIXTEENTH = "0x2c002c00"  # 1/16 in fp16 pairs

# Word layout (GGUF Q4): byte k of word t holds value 4t+k in its low nibble and 16+4t+k in its
# high one. A permute spreads bytes 0,1 (then 2,3) into the two halves of a register, so one mask
# yields the pair (4t, 4t+1) and another (16+4t, 17+4t) scaled by 16.
_DOT8 = """{{
.reg .b32 p, t0, t1, t2, t3, acc, clo, chi, csx;
.reg .b16 h0, h1;
.reg .f32 f0, f1, s;
mov.b32 clo, {low};
mov.b32 chi, {high};
mov.b32 csx, {sixteenth};
prmt.b32 p, $1, 0, 0x4140;
lop3.b32 t0, p, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t1, p, 0x00f000f0, 0x64006400, 0xea;
prmt.b32 p, $1, 0, 0x4342;
lop3.b32 t2, p, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t3, p, 0x00f000f0, 0x64006400, 0xea;
sub.f16x2 t0, t0, clo;
fma.rn.f16x2 t1, t1, csx, chi;
sub.f16x2 t2, t2, clo;
fma.rn.f16x2 t3, t3, csx, chi;
mul.f16x2 acc, t0, $2;
fma.rn.f16x2 acc, t2, $3, acc;
fma.rn.f16x2 acc, t1, $4, acc;
fma.rn.f16x2 acc, t3, $5, acc;
mov.b32 {{h0, h1}}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 s, f0, f1;
mov.b32 $0, s;
}}"""

_DOT8_Q4_0 = tl.constexpr(_DOT8.format(low=_LOW_BIAS[0], high=_HIGH_BIAS[0], sixteenth=_SIXTEENTH))
_DOT8_Q4_1 = tl.constexpr(_DOT8.format(low=_LOW_BIAS[1], high=_HIGH_BIAS[1], sixteenth=_SIXTEENTH))

_SUM8 = """{
.reg .b32 acc;
.reg .b16 h0, h1;
.reg .f32 f0, f1, s;
add.f16x2 acc, $1, $2;
add.f16x2 acc, acc, $3;
add.f16x2 acc, acc, $4;
mov.b32 {h0, h1}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 s, f0, f1;
mov.b32 $0, s;
}"""
_SUM8 = tl.constexpr(_SUM8)

# x pairs scaled by 1/16 (in f32, before the one rounding for bf16)
_BF16_PAIR = tl.constexpr("""{
.reg .b32 lo, hi;
shl.b32 lo, $1, 16;
and.b32 hi, $1, 0xffff0000;
mul.f32 lo, lo, 0f3D800000;
mul.f32 hi, hi, 0f3D800000;
cvt.rn.f16x2.f32 $0, hi, lo;
}""")

_F16_PAIR = tl.constexpr("""{
.reg .b32 c;
mov.b32 c, 0x2c002c00;
mul.f16x2 $0, $1, c;
}""")


@triton.jit
def fp16_bits_to_f32(bits):
    """The fp16 in the low 16 bits of an int32, as float32 (interpreter path)."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair_values(xw, X_F16: tl.constexpr):
    """A raw pair word of x (two bf16 or fp16) as float32 (low, high), each divided by 16."""
    if X_F16:
        return fp16_bits_to_f32(xw) * 0.0625, fp16_bits_to_f32(xw >> 16) * 0.0625
    lo = (xw << 16).to(tl.float32, bitcast=True)
    hi = (xw & -65536).to(tl.float32, bitcast=True)
    return lo * 0.0625, hi * 0.0625


@triton.jit
def _prepare_pair(xw, X_F16: tl.constexpr, ASM: tl.constexpr):
    """A raw pair word of x → the f16x2 word of x / 16 the dot reads (ASM), else left raw."""
    if ASM:
        if X_F16:
            return tl.inline_asm_elementwise(_F16_PAIR, "=r,r", [xw], dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise(_BF16_PAIR, "=r,r", [xw], dtype=tl.int32, is_pure=True, pack=1)
    return xw


@triton.jit
def _nibble(qw, shift: tl.constexpr, off: tl.constexpr):
    return ((qw >> shift) & 0x0F).to(tl.float32) - off


@triton.jit
def _dot8(qw, xa, xb, xc, xd, KIND: tl.constexpr, X_F16: tl.constexpr, ASM: tl.constexpr):
    """Σ (q - offset) · x / 16 over the word's eight values; xa..xd are the pairs at values
    (4t, 4t+2, 16+4t, 18+4t) of word t."""
    if ASM:
        if KIND == 0:
            return tl.inline_asm_elementwise(
                _DOT8_Q4_0, "=r,r,r,r,r,r", [qw, xa, xb, xc, xd], dtype=tl.float32, is_pure=True, pack=1
            )
        return tl.inline_asm_elementwise(
            _DOT8_Q4_1, "=r,r,r,r,r,r", [qw, xa, xb, xc, xd], dtype=tl.float32, is_pure=True, pack=1
        )
    off = 8.0 if KIND == 0 else 0.0
    a0, a1 = _pair_values(xa, X_F16)
    b0, b1 = _pair_values(xb, X_F16)
    c0, c1 = _pair_values(xc, X_F16)
    d0, d1 = _pair_values(xd, X_F16)
    low = (
        _nibble(qw, 0, off) * a0
        + _nibble(qw, 8, off) * a1
        + _nibble(qw, 16, off) * b0
        + _nibble(qw, 24, off) * b1
    )
    high = (
        _nibble(qw, 4, off) * c0
        + _nibble(qw, 12, off) * c1
        + _nibble(qw, 20, off) * d0
        + _nibble(qw, 28, off) * d1
    )
    return low + high


@triton.jit
def _sum8(xa, xb, xc, xd, X_F16: tl.constexpr, ASM: tl.constexpr):
    """Σ x / 16 over the word's eight values (Q4_1's offset term)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _SUM8, "=r,r,r,r,r", [xa, xb, xc, xd], dtype=tl.float32, is_pure=True, pack=1
        )
    a0, a1 = _pair_values(xa, X_F16)
    b0, b1 = _pair_values(xb, X_F16)
    c0, c1 = _pair_values(xc, X_F16)
    d0, d1 = _pair_values(xd, X_F16)
    return a0 + a1 + b0 + b1 + c0 + c1 + d0 + d1


@triton.jit
def _row_words(
    QW,
    D,
    MN,
    rows,
    blk,
    valid,
    xa,
    xb,
    xc,
    xd,
    xs,
    NB,
    KIND: tl.constexpr,
    EVEN_B: tl.constexpr,
    X_F16: tl.constexpr,
    ASM: tl.constexpr,
):
    """The weight rows' contributions over blocks blk, per word [ROWS, BB, 4], in x / 16 units;
    rows [ROWS, 1, 1], blk and valid [1, BB, 1]."""
    t = tl.arange(0, 4)[None, None, :]
    qw = tl.load(QW + rows * (NB * 4) + blk * 4 + t)
    d = tl.load(D + rows * NB + blk).to(tl.float32)
    if not EVEN_B:
        d = tl.where(valid, d, 0.0)
    part = _dot8(qw, xa, xb, xc, xd, KIND, X_F16, ASM) * d
    if KIND == 1:
        m = tl.load(MN + rows * NB + blk).to(tl.float32)
        if not EVEN_B:
            m = tl.where(valid, m, 0.0)
        part += xs * m
    return part


@triton.jit
def _gemv_half2_kernel(
    XW,
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
    """ROWS weight rows per program over [ROWS, BLOCK_B, 4] word tiles: a thread holds whole
    words of many rows, so x's pairs are loaded and converted once for all of them; products
    are summed per word and reduced once at the end."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rows = tl.minimum(offs, N - 1).to(tl.int64)[:, None, None]  # rows past N re-read N-1, never stored
    bb = tl.arange(0, BLOCK_B)[None, :, None]
    t = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((ROWS, BLOCK_B, 4), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        valid = (b0 + bb) < NB
        blk = b0 + bb if EVEN_B else tl.minimum(b0 + bb, NB - 1)
        x_off = blk * 16 + 2 * t  # [1, BB, 4]: the pair at word t's first value
        xa = _prepare_pair(tl.load(XW + x_off), X_F16, ASM)
        xb = _prepare_pair(tl.load(XW + x_off + 1), X_F16, ASM)
        xc = _prepare_pair(tl.load(XW + x_off + 8), X_F16, ASM)
        xd = _prepare_pair(tl.load(XW + x_off + 9), X_F16, ASM)
        xs = tl.zeros((1, BLOCK_B, 4), dtype=tl.float32)
        if KIND == 1:
            xs = _sum8(xa, xb, xc, xd, X_F16, ASM)
        acc += _row_words(QW, D, MN, rows, blk, valid, xa, xb, xc, xd, xs, NB, KIND, EVEN_B, X_F16, ASM)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * 16.0
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=offs < N)


def aligned_row(x: torch.Tensor, align: int) -> torch.Tensor:
    """x contiguous, and copied where its data does not start at a multiple of align bytes (the
    packed one-row kinds read x as wider words; a row view of a wider buffer may start mid-word)."""
    x = x.contiguous()
    if x.data_ptr() % align:
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
    return x


def launch_one_row(
    kernel: Any,
    x: torch.Tensor,
    x_words: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    kind: int,
    rows: int,
    block_b: int,
    num_warps: int,
    num_stages: int = 1,
) -> torch.Tensor:
    """y [1, N] in x's dtype from a one-row kernel over ceil(N / rows) programs: `_gemv_half2_kernel`
    and `quant_gemv_dp4a`'s kernel take the same arguments (x_words: x viewed as the words the
    kernel reads)."""
    n, nb = qs.shape[0], x.shape[1] // 32
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_b = min(block_b, triton.next_power_of_2(nb))
    kernel[(triton.cdiv(n, rows),)](
        x_words,
        qs.view(torch.int32),
        d,
        m if m is not None else d,
        y,
        n,
        nb,
        KIND=kind,
        ROWS=rows,
        BLOCK_B=block_b,
        EVEN_B=nb % block_b == 0,
        X_F16=x.dtype == torch.float16,
        ASM=not interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
        enable_fp_fusion=True,
        **pdl_args(x, kernel.__name__[1:].removesuffix("_kernel")),  # gemv_half2 or gemv_dp4a
    )
    return y


def one_16bit_row(x: torch.Tensor) -> bool:
    """Whether x is what the one-row kinds (half2, dp4a) take: one bf16 or fp16 row."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] == 1


def gemv_half2(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    qtype: str,
    rows: int,
    block_b: int,
    num_warps: int,
) -> torch.Tensor:
    """y [1, N] for x [1, K] (bf16 or fp16) and one `GpuBlocks`' arrays; rows per program a power
    of two up to 32."""
    if qtype not in HALF2_FORMATS:
        raise ValueError(f"gemv_half2 serves {', '.join(HALF2_FORMATS)}, got {qtype}")
    if rows not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"gemv_half2 takes a power of two up to 32 rows per program, got {rows}")
    x = aligned_row(x, 4)  # read as 32-bit pairs
    kind = 0 if qtype == "Q4_0" else 1
    return launch_one_row(
        _gemv_half2_kernel, x, x.view(torch.int32), qs, d, m, kind, rows, block_b, num_warps
    )
