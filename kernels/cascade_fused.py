"""Host side of the fused cascade impl: the layout of one launch (split counts of the shared
prefix and of the own tails, program counts) and the two launches, partial states then merge.
Promises: grid sizes come from the plan's host ints (no host sync, CUDA-graph capturable)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import dot_precision, next_pow2, split_block
from .cascade_fused_kernels import _cascade_fused_kernel, _cascade_merge_kernel
from .cascade_plan import CascadePlan, shared_groups_of
from .decode_splits import choose_num_splits

MIN_SHARED_CHUNK = 256  # keys; no shared-prefix program gets fewer (its fixed cost would dominate)


@dataclass(frozen=True)
class FusedLayout:
    """Host-side shape of one fused launch: split counts of the shared prefix (s_sh, 0 when no
    group shares anything) and of the own tails (s_own), and the two program counts."""

    s_sh: int
    s_own: int
    m_blocks: int
    n_shared_tiles: int
    n_own_tiles: int


def fused_layout(
    bsz: int,
    hq: int,
    hkv: int,
    plan: CascadePlan,
    cfg: dict,
    num_sms: int,
    shared_splits: int | None = None,
    own_splits: int | None = None,
) -> FusedLayout:
    """Split counts for one fused launch (explicit ones win): shared-prefix programs ~ shared_waves
    per SM, none shorter than MIN_SHARED_CHUNK keys; own tails split as plain decode would."""
    _, n_sg, max_sg = shared_groups_of(plan)
    if n_sg == 0 or plan.max_shared_len <= 0:
        s_sh, m_blocks = 0, 1
    else:
        m_blocks = -(-max_sg * (hq // hkv) // cfg["block_m"])
        cap = max(1, plan.max_shared_len // MIN_SHARED_CHUNK)
        want = round(cfg["shared_waves"] * num_sms / (n_sg * hkv * m_blocks))
        s_sh = shared_splits or max(1, min(cap, want))
    s_own = own_splits or choose_num_splits(
        bsz, hkv, plan.max_own_len, num_sms, cfg["own_block_n"] or cfg["block_n"]
    )
    return FusedLayout(s_sh, s_own, m_blocks, n_sg * hkv * m_blocks * s_sh, bsz * hkv * s_own)


def cascade_partial(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: CascadePlan,
    layout: FusedLayout,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    cfg: dict,
    part: str = "all",
) -> None:
    """Stage 1 of the fused impl, one launch: partial states into mid_o [B, Hq, s_sh + s_own, D] /
    mid_lse [B, Hq, s_sh + s_own]. part "shared" / "own" launches only those programs (benchmark
    diagnostics; the buffer is then incomplete)."""
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    n_sh = layout.n_shared_tiles if part in ("all", "shared") else 0
    n_own = layout.n_own_tiles if part in ("all", "own") else 0
    if n_sh + n_own == 0:
        return
    group = hq // hkv
    shared_groups, _, _ = shared_groups_of(plan)
    _cascade_fused_kernel[(n_sh + n_own,)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        plan.shared_lens,
        plan.group_ptr,
        plan.group_shared_lens,
        shared_groups,
        mid_o,
        mid_lse,
        sm_scale * 1.4426950408889634,
        n_sh,
        n_own,
        max(layout.s_sh, 1),
        layout.s_sh,
        layout.s_own,
        layout.m_blocks,
        hkv,
        hq,
        mid_o.shape[2],
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=next_pow2(d),
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_H=max(16, next_pow2(group)),
        OWN_BLOCK_N=cfg["own_block_n"] or cfg["block_n"],
        SHARED_FIRST=bool(cfg["shared_first"]),
        DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=True,
    )


def cascade_merge(
    mid_o: torch.Tensor, mid_lse: torch.Tensor, plan: CascadePlan, s_sh: int, out: torch.Tensor
) -> None:
    """Stage 2 of the fused impl: merge each (request, head)'s partial states into out [B, Hq, D]."""
    bsz, hq, s, d = mid_o.shape
    if bsz == 0:
        return
    _cascade_merge_kernel[(bsz, hq)](
        mid_o,
        mid_lse,
        plan.shared_lens,
        out,
        s,
        s_sh,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        BLOCK_D=next_pow2(d),
        BLOCK_S=split_block(s),
        num_warps=4 if d >= 128 else 2,
        enable_fp_fusion=True,
    )
