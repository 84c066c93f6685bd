"""merge_state: combine two partial attention states over disjoint key sets, (out_a, lse_a) and
(out_b, lse_b), into the state over their union by log-sum-exp weighting; merge_splits: the same
over S split states per row (split-K decode's second stage). Promises: equal `merge_state_ref` /
`merge_splits_ref`; an empty side (lse = -inf) leaves the other unchanged; all empty → 0, -inf."""

from __future__ import annotations

from typing import Literal, overload

import torch

from ._triton import next_pow2, pdl_args, pdl_wait, split_block, tl, triton, use_triton


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
            enable_fp_fusion=True,
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


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    MidO,
    MidLse,
    Out,
    OutLse,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, head): softmax-weighted sum of the per-split partial outputs."""
    pdl_wait(PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    base = (n * tl.num_programs(1) + h) * num_splits
    lse = tl.load(MidLse + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    o = tl.load(
        MidO + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + n * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)
    if WRITE_LSE:
        tl.store(OutLse + n * tl.num_programs(1) + h, tl.where(total > 0, m_safe + tl.log(total), m))


def merge_splits(
    mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor | None = None
) -> None:
    """Merge partial states mid_o [N, H, S, D] (fp32), mid_lse [N, H, S] into out [N, H, D]
    (any float dtype, last dim contiguous) and, if given, out_lse [N, H] fp32."""
    n, h, s, d = mid_o.shape
    if n == 0:
        return
    _merge_splits_kernel[(n, h)](
        mid_o,
        mid_lse,
        out,
        out_lse if out_lse is not None else mid_lse,
        s,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        BLOCK_D=next_pow2(d),
        BLOCK_S=split_block(s),
        WRITE_LSE=out_lse is not None,
        num_warps=4 if d >= 128 else 2,
        **pdl_args(out, "merge_splits"),
        enable_fp_fusion=True,
    )


def merge_splits_ref(mid_o: torch.Tensor, mid_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(mid_lse, dim=-1)
    w = torch.exp(mid_lse - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return (mid_o * w.unsqueeze(-1)).sum(-2), lse
