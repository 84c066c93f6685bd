"""merge_state: combine two partial attention states over disjoint key sets, (out_a, lse_a) and
(out_b, lse_b), into the state over their union by log-sum-exp weighting. Promises: equals
`merge_state_ref`; an empty side (lse = -inf) leaves the other unchanged; both empty → 0, -inf."""

from __future__ import annotations

from typing import Literal, overload

import torch

from ._triton import next_pow2, tl, triton, use_triton


@triton.jit
def _merge_state_kernel(
    Oa,
    La,
    Ob,
    Lb,
    Out,
    L,
    stride_an,
    stride_ah,
    stride_bn,
    stride_bh,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    la = tl.load(La + n * nh + h)
    lb = tl.load(Lb + n * nh + h)
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    oa = tl.load(Oa + n * stride_an + h * stride_ah + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    ob = tl.load(Ob + n * stride_bn + h * stride_bh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    out = (oa * wa + ob * wb) / tl.where(total > 0, total, 1.0)
    tl.store(Out + n * stride_on + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)
    if WRITE_LSE:
        tl.store(L + n * nh + h, tl.where(total > 0, m_safe + tl.log(total), m))


@overload
def merge_state(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def merge_state(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def merge_state(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out_* [N, H, D] (last dim contiguous), lse_* [N, H] fp32 contiguous → out [N, H, D]."""
    if out_a.shape != out_b.shape or lse_a.shape != out_a.shape[:2] or lse_b.shape != lse_a.shape:
        raise ValueError(
            f"state shapes disagree: {tuple(out_a.shape)}/{tuple(lse_a.shape)} vs "
            f"{tuple(out_b.shape)}/{tuple(lse_b.shape)}"
        )
    if not use_triton(out_a):
        o, ref_lse = merge_state_ref(out_a, lse_a, out_b, lse_b)
        o = o.to(out_dtype or out_a.dtype)
        o = out.copy_(o) if out is not None else o
        return (o, ref_lse) if return_lse else o
    n, h, d = out_a.shape
    out = (
        out
        if out is not None
        else torch.empty(out_a.shape, dtype=out_dtype or out_a.dtype, device=out_a.device)
    )
    lse = torch.empty_like(lse_a) if return_lse else None
    if n > 0:
        _merge_state_kernel[(n, h)](
            out_a,
            lse_a.contiguous(),
            out_b,
            lse_b.contiguous(),
            out,
            lse if lse is not None else lse_a,
            out_a.stride(0),
            out_a.stride(1),
            out_b.stride(0),
            out_b.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            BLOCK_D=next_pow2(d),
            WRITE_LSE=return_lse,
            num_warps=1 if d <= 128 else 2,
        )
    if return_lse:
        assert lse is not None
        return out, lse
    return out


def merge_state_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch: softmax weights of the two states from their log-sum-exps."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a.float() - safe).unsqueeze(-1)
    wb = torch.exp(lse_b.float() - safe).unsqueeze(-1)
    return out_a.float() * wa + out_b.float() * wb, lse
