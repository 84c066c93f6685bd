"""Cascade decode attention for forks: requests in a group share a cached prefix (the same KV
slots); the shared part is attended once per group (all the group's query heads packed into the
rows of one tensor-core tile per KV head, so the prefix is read once per group, not once per
request), each request's own tail separately, and the two merged by log-sum-exp.
Default impl "fused": ONE launch whose programs are the shared-prefix tiles then the own-tail
tiles (so neither part leaves the GPU idle), writing one split buffer, then one merge launch.
impl="two_launch" (cascade_two_launch.py): a shared-prefix kernel, split-K decode, then a merge.
Promises: equals plain decode attention over the whole sequence (`cascade_decode_attention_ref`);
no host sync (grid sizes come from the plan's host ints), so it can be captured in a CUDA graph."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._attn_common import finish_state, online_update
from ._triton import dot_precision, mma, next_pow2, split_block, tl, triton, use_triton
from .cascade_plan import CascadePlan, shared_groups_of
from .cascade_two_launch import two_launch
from .decode_attention import choose_num_splits, decode_attention_ref
from .merge_state import merge_state_ref

__all__ = ["CascadePlan", "cascade_decode_attention", "cascade_decode_attention_ref", "fused_layout",
           "resolve_config"]

# Tile/split defaults per impl. FUSED_DEFAULTS is what benchmarks/kernels.py --sweep prints as
# "adopt:"; paste its best line here. shared_waves: shared-prefix programs per SM (the split count
# of the shared prefix follows from it); own programs follow choose_num_splits (as plain decode);
# own_block_n None = block_n.
# Own tails take 128-key tiles and the shared prefix 1.5 programs per SM: the fastest line for 64
# requests sharing 8192 tokens with 256 of their own (benchmarks/results/kernels_h200_cascade.json).
FUSED_DEFAULTS: dict = {"block_m": 64, "block_n": 64, "own_block_n": 128, "num_warps": 4, "num_stages": 3,
                        "shared_waves": 1.5, "shared_first": True}
TWO_LAUNCH_DEFAULTS: dict = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
MIN_SHARED_CHUNK = 256  # keys; no shared-prefix program gets fewer (its fixed cost would dominate)


# --------------------------------------------------------------------------- fused (one launch)

@triton.jit
def _fold_block(q, m_i, l_i, acc, row_ptr, K, V, kvh, n0, hi, qk_scale, offs_d, mask_d,
                stride_kt, stride_kh, stride_vt, stride_vh,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold keys n0..n0+BLOCK_N-1 (only those < hi when MASKED) into the running state."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    if MASKED:
        slots = tl.load(row_ptr + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        slots = tl.load(row_ptr + offs_n)
        kv_mask = mask_d[None, :]  # broadcast over the block's rows
    k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = mma(q, tl.trans(k), DOT_PREC) * qk_scale
    if MASKED:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
    v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    return online_update(qk, m_i, l_i, acc, v, DOT_PREC)


@triton.jit
def _attend_store(q, row_ptr, K, V, kvh, lo, hi, qk_scale, offs_d, mask_d, out_idx, mask_rows, MidO, MidLse,
                  stride_kt, stride_kh, stride_vt, stride_vh,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """Attend ROWS query rows q to keys lo..hi-1 of one request row (whole blocks unmasked, then a
    masked tail) and store the partial state (out, lse) at split-buffer indices out_idx."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    hi = tl.maximum(hi, lo)
    n_full = lo + (hi - lo) // BLOCK_N * BLOCK_N
    for n0 in range(lo, n_full, BLOCK_N):
        m_i, l_i, acc = _fold_block(q, m_i, l_i, acc, row_ptr, K, V, kvh, n0, hi, qk_scale, offs_d, mask_d,
                                    stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N, False, DOT_PREC)
    if n_full < hi:
        m_i, l_i, acc = _fold_block(q, m_i, l_i, acc, row_ptr, K, V, kvh, n_full, hi, qk_scale, offs_d, mask_d,
                                    stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N, True, DOT_PREC)
    out, lse = finish_state(m_i, l_i, acc)
    tl.store(MidO + out_idx[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_rows[:, None] & mask_d[None, :])
    tl.store(MidLse + out_idx, lse, mask=mask_rows)


@triton.jit
def _shared_tile(t, Q, K, V, ReqToToken, ReqIdx, GroupPtr, GroupShared, SharedGroups, MidO, MidLse, qk_scale,
                 s_div, m_blocks, num_kv_heads, num_q_heads, split_stride,
                 stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rr,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Shared tile t: BLOCK_M rows (member * GROUP + head) of one group and KV head against one
    of s_div splits of the group's shared prefix (m-block fastest, so the tiles reading one
    K/V chunk run side by side and share it through L2)."""
    mb = t % m_blocks
    kvh = (t // m_blocks) % num_kv_heads
    split = (t // (m_blocks * num_kv_heads)) % s_div
    g = tl.load(SharedGroups + t // (m_blocks * num_kv_heads * s_div))
    r0 = tl.load(GroupPtr + g)
    n_rows = (tl.load(GroupPtr + g + 1) - r0).to(tl.int32) * GROUP
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_r = rows < n_rows
    reqs = r0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    shared = tl.where(mb * BLOCK_M < n_rows, tl.load(GroupShared + g).to(tl.int32), 0)
    per_split = tl.cdiv(tl.cdiv(shared, s_div), BLOCK_N) * BLOCK_N
    lo = split * per_split
    q = tl.load(Q + reqs[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    _attend_store(q, ReqToToken + tl.load(ReqIdx + r0) * stride_rr, K, V, kvh, lo,
                  tl.minimum(lo + per_split, shared), qk_scale, offs_d, mask_d,
                  (reqs * num_q_heads + heads) * split_stride + split, mask_r, MidO, MidLse,
                  stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PREC)


@triton.jit
def _own_tile(t, Q, K, V, ReqToToken, ReqIdx, SeqLens, KvStart, MidO, MidLse, qk_scale,
              s_sh, s_own, num_kv_heads, num_q_heads, split_stride,
              stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rr,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Own tile t: one request's GROUP heads of one KV head against one of s_own splits of its
    own tail (kv_start..seq_len-1); written at split index s_sh + split."""
    split = t % s_own
    kvh = (t // s_own) % num_kv_heads
    b = t // (s_own * num_kv_heads)
    local_h = tl.arange(0, BLOCK_H)
    mask_h = local_h < GROUP
    heads = kvh * GROUP + local_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = tl.load(KvStart + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, s_own), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    _attend_store(q, ReqToToken + tl.load(ReqIdx + b) * stride_rr, K, V, kvh, lo,
                  tl.minimum(lo + per_split, seq_len), qk_scale, offs_d, mask_d,
                  (b * num_q_heads + heads) * split_stride + s_sh + split, mask_h, MidO, MidLse,
                  stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_H, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PREC)


@triton.jit(do_not_specialize=["n_shared_tiles", "n_own_tiles", "s_div", "s_sh", "s_own", "m_blocks",
                             "split_stride"])
def _cascade_fused_kernel(
    Q, K, V, ReqToToken, ReqIdx, SeqLens, KvStart, GroupPtr, GroupShared, SharedGroups, MidO, MidLse,
    qk_scale, n_shared_tiles, n_own_tiles, s_div, s_sh, s_own, m_blocks, num_kv_heads, num_q_heads, split_stride,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, OWN_BLOCK_N: tl.constexpr, SHARED_FIRST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Programs [0, n_shared_tiles) are shared-prefix tiles, the rest own-tail tiles (swapped
    when not SHARED_FIRST). Splits 0..s_sh-1 of the buffer hold the shared part, s_sh.. the own
    part; s_div = max(s_sh, 1) (s_sh is 0 when no group shares anything: no shared tile runs)."""
    pid = tl.program_id(0)
    if SHARED_FIRST:
        is_shared = pid < n_shared_tiles
        t = tl.where(is_shared, pid, pid - n_shared_tiles)
    else:
        is_shared = pid >= n_own_tiles
        t = tl.where(is_shared, pid - n_own_tiles, pid)
    if is_shared:
        _shared_tile(t, Q, K, V, ReqToToken, ReqIdx, GroupPtr, GroupShared, SharedGroups, MidO, MidLse, qk_scale,
                     s_div, m_blocks, num_kv_heads, num_q_heads, split_stride,
                     stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rr,
                     GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, DOT_PREC)
    else:
        _own_tile(t, Q, K, V, ReqToToken, ReqIdx, SeqLens, KvStart, MidO, MidLse, qk_scale,
                  s_sh, s_own, num_kv_heads, num_q_heads, split_stride,
                  stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rr,
                  GROUP, HEAD_DIM, BLOCK_D, BLOCK_H, OWN_BLOCK_N, DOT_PREC)


@triton.jit(do_not_specialize=["num_splits", "s_sh"])
def _cascade_merge_kernel(
    MidO, MidLse, SharedLens, Out, num_splits, s_sh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (request, head): softmax-weighted sum of its partial states; the shared
    splits (0..s_sh-1) only count for requests with a shared part (others never wrote them)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    first = tl.where(tl.load(SharedLens + b) > 0, 0, s_sh)
    mask_s = (offs_s < num_splits) & (offs_s >= first)
    mask_d = offs_d < HEAD_DIM
    base = (b * tl.num_programs(1) + h) * num_splits
    lse = tl.load(MidLse + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w, 0)
    o = tl.load(MidO + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@dataclass(frozen=True)
class FusedLayout:
    """Host-side shape of one fused launch: split counts of the shared prefix (s_sh, 0 when no
    group shares anything) and of the own tails (s_own), and the two program counts."""

    s_sh: int
    s_own: int
    m_blocks: int
    n_shared_tiles: int
    n_own_tiles: int


def resolve_config(impl: str = "fused", **given: object) -> dict:
    """The impl's defaults overridden by the knobs given (None = default); unknown knobs raise."""
    if impl not in ("fused", "two_launch"):
        raise ValueError(f"impl must be 'fused' or 'two_launch', not {impl!r}")
    base = FUSED_DEFAULTS if impl == "fused" else TWO_LAUNCH_DEFAULTS
    given = {k: v for k, v in given.items() if v is not None}
    if given.keys() - base.keys():
        raise ValueError(f"impl {impl!r} has no knob(s) {sorted(given.keys() - base.keys())}")
    return base | given


def fused_layout(bsz: int, hq: int, hkv: int, plan: CascadePlan, cfg: dict, num_sms: int,
                 shared_splits: int | None = None, own_splits: int | None = None) -> FusedLayout:
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
    s_own = own_splits or choose_num_splits(bsz, hkv, plan.max_own_len, num_sms, cfg["own_block_n"] or cfg["block_n"])
    return FusedLayout(s_sh, s_own, m_blocks, n_sg * hkv * m_blocks * s_sh, bsz * hkv * s_own)


def cascade_partial(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, plan: CascadePlan, layout: FusedLayout,
    mid_o: torch.Tensor, mid_lse: torch.Tensor, sm_scale: float, cfg: dict, part: str = "all",
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
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, plan.shared_lens, plan.group_ptr,
        plan.group_shared_lens, shared_groups, mid_o, mid_lse, sm_scale * 1.4426950408889634, n_sh, n_own,
        max(layout.s_sh, 1), layout.s_sh, layout.s_own, layout.m_blocks, hkv, hq, mid_o.shape[2],
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_H=max(16, next_pow2(group)), OWN_BLOCK_N=cfg["own_block_n"] or cfg["block_n"],
        SHARED_FIRST=bool(cfg["shared_first"]), DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def cascade_merge(mid_o: torch.Tensor, mid_lse: torch.Tensor, plan: CascadePlan, s_sh: int, out: torch.Tensor) -> None:
    """Stage 2 of the fused impl: merge each (request, head)'s partial states into out [B, Hq, D]."""
    bsz, hq, s, d = mid_o.shape
    if bsz == 0:
        return
    _cascade_merge_kernel[(bsz, hq)](
        mid_o, mid_lse, plan.shared_lens, out, s, s_sh, out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_S=split_block(s), num_warps=4 if d >= 128 else 2,
    )


def cascade_decode_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, plan: CascadePlan,
    sm_scale: float | None = None, fused_merge: bool = True, shared_splits: int | None = None,
    own_splits: int | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, impl: str = "fused",
    own_block_n: int | None = None, shared_waves: float | None = None, shared_first: bool | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] → out [B, Hq, D]. impl "fused" (default): one launch of shared + own programs,
    then one merge; knobs default to FUSED_DEFAULTS. impl "two_launch": the shared kernel and the
    split-K decode kernel; fused_merge: both write one split buffer merged by a single kernel,
    otherwise each part is finished separately and joined by `merge_state`."""
    bsz, hq, d = q.shape
    if hq % k_buffer.shape[1] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({k_buffer.shape[1]})")
    cfg = resolve_config(impl, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                         own_block_n=own_block_n, shared_waves=shared_waves, shared_first=shared_first)
    if not use_triton(q):
        return cascade_decode_attention_ref(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                                            plan, sm_scale)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    if impl == "two_launch":
        return two_launch(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, plan, sm_scale,
                           fused_merge, shared_splits, own_splits, cfg, sms, out)
    lay = fused_layout(bsz, hq, k_buffer.shape[1], plan, cfg, sms, shared_splits, own_splits)
    mid_o = torch.empty((bsz, hq, lay.s_sh + lay.s_own, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bsz, hq, lay.s_sh + lay.s_own), dtype=torch.float32, device=q.device)
    cascade_partial(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, plan, lay, mid_o, mid_lse,
                    sm_scale, cfg)
    cascade_merge(mid_o, mid_lse, plan, lay.s_sh, out)
    return out


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
