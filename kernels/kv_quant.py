"""FP8 (e4m3) KV-cache numerics shared by every pool writer and reader: the storage dtype, the
rule stored = clamp(x / scale, ±448) cast to e4m3 (one fp32 scale per KV head), dequantization,
the scale folding for the kernels that do not apply the scales themselves (K scale into q, V scale
into the output), so such a kernel only converts the fp8 rows it loads to q's dtype, and which
widening a kernel reading an fp8 pool compiles. Plain torch, no host sync."""

from __future__ import annotations

import torch

from ._triton import interpreting

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D], scale [Hkv] fp32 → e4m3 of clamp(x / scale, ±448) (fp32 math, one rounding)."""
    return (x.float() / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(
    x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x [..., Hkv, D] (any float dtype) → x * scale in dtype; scale None means 1."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.float()[:, None]).to(dtype)


def per_query_head(scale: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[Hkv] → [Hq]: query head h reads KV head h // (Hq / Hkv). View ops only (graph-safe)."""
    hkv = scale.shape[0]
    return scale[:, None].expand(hkv, num_q_heads // hkv).reshape(num_q_heads)


def fold_k_scale(q: torch.Tensor, k_scale: torch.Tensor | None) -> torch.Tensor:
    """q [T, Hq, D] times its KV head's K scale, in q's dtype: q·(k8·s) == (q·s)·k8, so the
    kernel's scores need no per-key multiply."""
    if k_scale is None:
        return q
    return (q.float() * per_query_head(k_scale, q.shape[1])[:, None]).to(q.dtype)


def apply_v_scale(out: torch.Tensor, v_scale: torch.Tensor | None) -> torch.Tensor:
    """out [T, Hq, D] *= its KV head's V scale, in place (softmax weights sum to 1, so scaling
    every value row of a head equals scaling that head's output)."""
    if v_scale is not None:
        out.mul_(per_query_head(v_scale.float(), out.shape[1])[:, None])  # fp32 math, one rounding
    return out


def widen_f16(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether an fp8 pool's rows are widened to float16 (with q scaled and cast to it) rather
    than to q's bfloat16: e4m3 pairs widen to float16 in one packed conversion, to bfloat16 only
    through float32, and that conversion bounds the fp8 decode kernel. Every e4m3 value is exact in
    float16."""
    return k_buffer.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def widen_v_in_registers(q: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether an fp8 pool's V tile is widened to float16 in registers, then staged for the
    tensor cores as float16. Left to itself, Triton widens V after reading it from shared memory
    in the tensor cores' operand layout; V's reduction axis (keys) is its strided one, so that
    read goes one byte at a time (128 byte loads per thread per 128-key tile at D 128). CUDA only:
    the widening is inline PTX."""
    return widen_f16(q, v_buffer) and q.is_cuda and not interpreting()
