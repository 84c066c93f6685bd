"""Cascade decode attention for forks: requests in a group share a cached prefix (the same KV
slots); the shared part is attended once per group (all the group's query heads packed into the
rows of one tensor-core tile per KV head, so the prefix is read once per group, not once per
request), each request's own tail separately, and the two merged by log-sum-exp.
Default impl "fused": ONE launch whose programs are the shared-prefix tiles then the own-tail
tiles (so neither part leaves the GPU idle), writing one split buffer, then one merge launch.
impl="two_launch" (cascade_two_launch.py): a shared-prefix kernel, split-K decode, then a merge.
An fp8 pool is read as is: its K scale is folded into q, its V scale into the output.
Promises: equals plain decode attention over the whole sequence (`cascade_decode_attention_ref`);
no host sync (grid sizes come from the plan's host ints), so it can be captured in a CUDA graph."""

from __future__ import annotations

import math

import torch

from ._triton import use_triton
from .cascade_fused import MIN_SHARED_CHUNK as MIN_SHARED_CHUNK
from .cascade_fused import FusedLayout as FusedLayout
from .cascade_fused import cascade_merge, cascade_partial, fused_layout
from .cascade_fused_kernels import _cascade_fused_kernel as _cascade_fused_kernel
from .cascade_plan import CascadePlan
from .cascade_two_launch import two_launch
from .decode_attention import decode_attention_ref
from .kv_quant import apply_v_scale, fold_k_scale
from .merge_state import merge_state_ref

# Names imported `as` themselves are re-exported: the fused impl's layout and launches
# (cascade_fused.py) and kernel (cascade_fused_kernels.py), where the benchmarks look for them.
__all__ = [
    "CascadePlan",
    "cascade_decode_attention",
    "cascade_decode_attention_ref",
    "fused_layout",
    "resolve_config",
]

# Tile/split defaults per impl. FUSED_DEFAULTS is what benchmarks/kernels.py --sweep prints as
# "adopt:"; paste its best line here. shared_waves: shared-prefix programs per SM (the split count
# of the shared prefix follows from it); own programs follow choose_num_splits (as plain decode);
# own_block_n None = block_n.
# Own tails take 128-key tiles and the shared prefix 1.5 programs per SM: the fastest line for 64
# requests sharing 8192 tokens with 256 of their own (benchmarks/results/kernels_h200_cascade.json).
FUSED_DEFAULTS: dict = {
    "block_m": 64,
    "block_n": 64,
    "own_block_n": 128,
    "num_warps": 4,
    "num_stages": 3,
    "shared_waves": 1.5,
    "shared_first": True,
}
TWO_LAUNCH_DEFAULTS: dict = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}


def resolve_config(impl: str = "fused", **given: object) -> dict:
    """The impl's defaults overridden by the knobs given (None = default); unknown knobs raise."""
    if impl not in ("fused", "two_launch"):
        raise ValueError(f"impl must be 'fused' or 'two_launch', not {impl!r}")
    base = FUSED_DEFAULTS if impl == "fused" else TWO_LAUNCH_DEFAULTS
    given = {k: v for k, v in given.items() if v is not None}
    if given.keys() - base.keys():
        raise ValueError(f"impl {impl!r} has no knob(s) {sorted(given.keys() - base.keys())}")
    return base | given


def cascade_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: CascadePlan,
    sm_scale: float | None = None,
    fused_merge: bool = True,
    shared_splits: int | None = None,
    own_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    impl: str = "fused",
    own_block_n: int | None = None,
    shared_waves: float | None = None,
    shared_first: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] → out [B, Hq, D]. k_scale / v_scale [Hkv] fp32: the buffers hold K / scale,
    V / scale (an fp8 pool); None = 1. impl "fused" (default): one launch of shared + own programs,
    then one merge; knobs default to FUSED_DEFAULTS. impl "two_launch": the shared kernel and the
    split-K decode kernel; fused_merge: both write one split buffer merged by a single kernel,
    otherwise each part is finished separately and joined by `merge_state`."""
    bsz, hq, d = q.shape
    if hq % k_buffer.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({k_buffer.shape[1]})")
    cfg = resolve_config(
        impl,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        own_block_n=own_block_n,
        shared_waves=shared_waves,
        shared_first=shared_first,
    )
    if not use_triton(q):
        return cascade_decode_attention_ref(
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, plan, sm_scale, k_scale, v_scale
        )
    out = torch.empty_like(q)
    q = fold_k_scale(q, k_scale)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    if bsz == 0:
        return out
    if impl == "two_launch":
        out = two_launch(
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            plan,
            sm_scale,
            fused_merge,
            shared_splits,
            own_splits,
            cfg,
            sms,
            out,
        )
        return apply_v_scale(out, v_scale)
    lay = fused_layout(bsz, hq, k_buffer.shape[1], plan, cfg, sms, shared_splits, own_splits)
    mid_o = torch.empty((bsz, hq, lay.s_sh + lay.s_own, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bsz, hq, lay.s_sh + lay.s_own), dtype=torch.float32, device=q.device)
    cascade_partial(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        plan,
        lay,
        mid_o,
        mid_lse,
        sm_scale,
        cfg,
    )
    cascade_merge(mid_o, mid_lse, plan, lay.s_sh, out)
    return apply_v_scale(out, v_scale)


def cascade_decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: CascadePlan,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch: the shared part read through each group's first member's row, the own part through
    each request's row, joined by merge_state's reference (fp32 until the end); K/V dequantized."""
    first = torch.repeat_interleave(plan.group_ptr[:-1], plan.group_ptr.diff())
    qf = q.float()
    zero = torch.zeros_like(plan.shared_lens)
    o_sh, l_sh = decode_attention_ref(
        qf,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices[first],
        plan.shared_lens,
        sm_scale,
        zero,
        k_scale,
        v_scale,
    )
    o_own, l_own = decode_attention_ref(
        qf,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        plan.shared_lens,
        k_scale,
        v_scale,
    )
    return merge_state_ref(o_sh, l_sh, o_own, l_own)[0].to(q.dtype)
