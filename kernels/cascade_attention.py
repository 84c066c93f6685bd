"""Cascade decode attention for forks: requests in a group share a cached prefix (the same KV
slots); the shared part is attended once per group (all the group's query heads packed into the
rows of one tensor-core tile per KV head, so the prefix is read once per group, not once per
request), each request's own tail by the split-K decode kernel, and the two merged by log-sum-exp.
Promises: equals plain decode attention over the whole sequence (`cascade_decode_attention_ref`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixlm.kernels._attn_common import finish_state, online_update
from radixlm.kernels._triton import dot_precision, mma, next_pow2, tl, triton, use_triton
from radixlm.kernels.decode_attention import (
    choose_num_splits,
    decode_attention_ref,
    decode_partial,
    merge_splits,
)
from radixlm.kernels.merge_state import merge_state, merge_state_ref


@dataclass
class CascadePlan:
    """Groups are contiguous runs of the batch: group g is requests group_ptr[g]..group_ptr[g+1]-1,
    sharing the first group_shared_lens[g] tokens of the first member's req_to_token row."""

    group_ptr: torch.Tensor  # [G + 1] int64, device
    group_shared_lens: torch.Tensor  # [G] int64, device
    shared_lens: torch.Tensor  # [B] int64 per request, device (kv_start of its own part)
    max_group_size: int
    max_shared_len: int
    max_own_len: int


def make_cascade_plan(group_sizes: list[int], shared_lens: list[int], seq_lens: list[int],
                      device: torch.device | str) -> CascadePlan:
    """Host-side: build the plan from per-group sizes and shared lengths and per-request lengths."""
    if sum(group_sizes) != len(seq_lens) or len(shared_lens) != len(group_sizes):
        raise ValueError("group sizes must cover the batch and match the shared lengths")
    per_req = [s for s, n in zip(shared_lens, group_sizes) for _ in range(n)]
    if any(s < 0 or s > L for s, L in zip(per_req, seq_lens)):
        raise ValueError("a shared prefix is longer than a member's sequence")
    ptr = [0]
    for n in group_sizes:
        ptr.append(ptr[-1] + n)
    as_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    return CascadePlan(as_dev(ptr), as_dev(shared_lens), as_dev(per_req), max(group_sizes, default=0),
                       max(shared_lens, default=0), max((L - s for L, s in zip(seq_lens, per_req)), default=0))


@triton.jit
def _shared_prefix_kernel(
    Q, K, V, ReqToToken, ReqIdx, GroupPtr, GroupShared, MidO, MidLse,
    sm_scale, num_splits, num_m_blocks, num_q_heads, split_stride,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    g = tl.program_id(0)
    kvh = tl.program_id(1) // num_m_blocks
    mb = tl.program_id(1) % num_m_blocks
    split = tl.program_id(2)
    r0 = tl.load(GroupPtr + g)
    n_rows = (tl.load(GroupPtr + g + 1) - r0).to(tl.int32) * GROUP
    if mb * BLOCK_M >= n_rows:
        return
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # row = member * GROUP + head within the KV group
    mask_r = rows < n_rows
    reqs = r0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    shared = tl.load(GroupShared + g).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(shared, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, shared)

    q = tl.load(Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    row_ptr = ReqToToken + tl.load(ReqIdx + r0) * stride_rr
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = online_update(qk, m_i, l_i, acc, v, DOT_PREC)

    out, lse = finish_state(m_i, l_i, acc)
    base = (reqs * num_q_heads + heads) * split_stride + split
    tl.store(MidO + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_r[:, None] & mask_d[None, :])
    tl.store(MidLse + base, lse, mask=mask_r)


def _shared_launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, plan, mid_o, mid_lse,
                   num_splits, sm_scale, block_m, block_n, num_warps, num_stages) -> None:
    hq, d = q.shape[1], q.shape[2]
    hkv = k_buffer.shape[1]
    group = hq // hkv
    num_m_blocks = triton.cdiv(plan.max_group_size * group, block_m)
    grid = (plan.group_shared_lens.shape[0], hkv * num_m_blocks, num_splits)
    _shared_prefix_kernel[grid](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, plan.group_ptr, plan.group_shared_lens,
        mid_o, mid_lse, sm_scale, num_splits, num_m_blocks, hq, mid_o.shape[2],
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(d),
        DOT_PREC=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )


def cascade_decode_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, plan: CascadePlan,
    sm_scale: float | None = None, fused_merge: bool = True, shared_splits: int | None = None,
    own_splits: int | None = None, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """q [B, Hq, D] → out [B, Hq, D]. fused_merge: both parts write one split buffer merged by a
    single kernel; otherwise each part is finished separately and joined by `merge_state`."""
    bsz, hq, d = q.shape
    if hq % k_buffer.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({k_buffer.shape[1]})")
    if not use_triton(q):
        return cascade_decode_attention_ref(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                            plan, sm_scale)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    hkv = k_buffer.shape[1]
    n_groups = int(plan.group_shared_lens.shape[0])
    m_blocks = triton.cdiv(plan.max_group_size * (hq // hkv), block_m)
    s_sh = shared_splits or choose_num_splits(n_groups * m_blocks, hkv, plan.max_shared_len, sms, block_n, 512)
    s_own = own_splits or choose_num_splits(bsz, hkv, plan.max_own_len, sms, block_n)
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    if fused_merge:
        mid_o = torch.empty((bsz, hq, s_sh + s_own, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bsz, hq, s_sh + s_own), dtype=torch.float32, device=q.device)
        _shared_launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, plan, mid_o, mid_lse, s_sh,
                       sm_scale, block_m, block_n, num_warps, num_stages)
        decode_partial(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, plan.shared_lens,
                       mid_o, mid_lse, s_sh, s_own, sm_scale, block_n, num_warps, num_stages)
        merge_splits(mid_o, mid_lse, out)
        return out
    states = []
    for s, shared in ((s_sh, True), (s_own, False)):
        mid_o = torch.empty((bsz, hq, s, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bsz, hq, s), dtype=torch.float32, device=q.device)
        if shared:
            _shared_launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, plan, mid_o, mid_lse, s,
                           sm_scale, block_m, block_n, num_warps, num_stages)
        else:
            decode_partial(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, plan.shared_lens,
                           mid_o, mid_lse, 0, s, sm_scale, block_n, num_warps, num_stages)
        o = torch.empty((bsz, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device)
        merge_splits(mid_o, mid_lse, o, lse)
        states.append((o, lse))
    return merge_state(states[0][0], states[0][1], states[1][0], states[1][1], out=out)


def cascade_decode_attention_ref(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, plan: CascadePlan,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Torch: the shared part read through each group's first member's row, the own part through
    each request's row, joined by merge_state's reference (fp32 until the end)."""
    first = torch.repeat_interleave(plan.group_ptr[:-1], plan.group_ptr.diff())
    qf = q.float()
    zero = torch.zeros_like(plan.shared_lens)
    o_sh, l_sh = decode_attention_ref(qf, k_buffer, v_buffer, req_to_token, req_pool_indices[first],
                                      plan.shared_lens, sm_scale, zero)
    o_own, l_own = decode_attention_ref(qf, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                        sm_scale, plan.shared_lens)
    return merge_state_ref(o_sh, l_sh, o_own, l_own)[0].to(q.dtype)
