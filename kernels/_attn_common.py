"""Triton building blocks shared by the attention kernels: the online-softmax step (base-2
exponent, fp32 state) and the final (out, lse) of a partial state. Promises: rows that saw no
key keep m = -inf, l = 0 and finish as out = 0, lse = -inf (never NaN)."""

from __future__ import annotations

from ._triton import mma, tl, triton


@triton.jit
def online_update(qk, m_i, l_i, acc, v, DOT_PREC: tl.constexpr):
    """Fold one block of scores qk [M, N] (already scaled by log2 e, masked to -inf) and its
    values v [N, D] into the running max m_i, sum l_i and accumulator acc."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def finish_state(m_i, l_i, acc):
    """(normalised out [M, D], natural-log lse [M]) of a running state."""
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return out, lse


@triton.jit
def widen_e4m3_f16(x):
    """fp8 e4m3 → float16, exact, four values per 32-bit register through two packed
    conversions. Not marked pure, so the compiler keeps it where it stands: it will not sink the
    widening past a layout change into the tensor cores' operand layout (see
    kv_quant.widen_v_in_registers)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )
