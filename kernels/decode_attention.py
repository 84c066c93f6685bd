"""Paged decode attention (one new token per request) over the KV pool, split-K flash-decoding
with GQA grouping: one program serves all query heads of a KV head, so each K/V row is read once
and QK^T / PV run on tensor cores; partial (out, lse) per KV split (`decode_partial`), then a
merge kernel, or, with split counters from the caller, the last split to finish merges in the same
launch (with one split the partial kernel writes the output itself). An fp8 pool is read as is, its rows widened to
float16 in the kernel (the dots then run in float16, q scaled into it; on CUDA, V is widened in
registers: kv_quant.widen_v_in_registers); its K and V scales, one per KV head, are applied
inside the kernel, to the scores and to the output.
Promises: `decode_attention` equals `decode_attention_ref` (softmax over each request's slots
kv_start..seq_len-1 read through req_to_token, page size 1, K/V dequantized) and never syncs
with the host."""

from __future__ import annotations

import math
from typing import Literal, overload

import torch

from ._triton import use_triton
from .decode_attention_ref import decode_attention_ref
from .decode_partial import decode_partial, merges_inside
from .decode_splits import choose_decode_splits, decode_block_n
from .merge_state import merge_splits

__all__ = ["decode_attention", "decode_attention_ref", "decode_partial", "merge_splits"]


@overload
def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: Literal[False] = False,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    return_lse: Literal[True],
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] → out [B, Hq, D] (q's dtype); attends to positions kv_start[b]..seq_lens[b]-1.
    num_splits (or max_len, host-side, to pick it) fixes the grid: no device→host sync.
    k_scale / v_scale [Hkv] fp32: the buffers hold K / scale, V / scale (an fp8 pool); None = 1.
    The lse is of the dequantized scores, as the reference's. block_n None: decode_block_n.
    split_counters: int32 zeros, at least B * Hkv, owned by the caller and used by one stream at
    a time; with them several splits merge inside the one launch (they are left at zero)."""
    if not use_triton(q):
        o, ref_lse = decode_attention_ref(
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            sm_scale,
            kv_start,
            k_scale,
            v_scale,
        )
        if out is not None:
            out.copy_(o)
            o = out
        return (o, ref_lse) if return_lse else o
    bsz, hq, d = q.shape
    hkv = k_buffer.shape[1]
    _check_heads(hq, hkv, d, k_buffer)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    block_n = block_n or decode_block_n(k_buffer)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits = choose_decode_splits(
            bsz, hkv, max_len if max_len is not None else 4096, sms, k_buffer.dtype
        )
    out = out if out is not None else torch.empty_like(q)
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device) if return_lse else None
    if bsz == 0:
        if return_lse:
            assert lse is not None
            return out, lse
        return out
    one = num_splits == 1  # the state needs no merge: the kernel writes out (and lse) itself
    counters = split_counters if merges_inside(split_counters, bsz, hq, hkv) else None
    mid_o = out if one else q.new_empty((bsz, hq, num_splits, d), dtype=torch.float32)
    mid_lse = lse if one and lse is not None else q.new_empty((bsz, hq, num_splits), dtype=torch.float32)
    decode_partial(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_start,
        mid_o,
        mid_lse,
        0,
        num_splits,
        sm_scale,
        block_n,
        num_warps,
        num_stages,
        out=out if one or counters is not None else None,
        out_lse=lse if one or counters is not None else None,
        k_scale=k_scale,
        v_scale=v_scale,
        counters=None if one else counters,
    )
    if not one and counters is None:
        merge_splits(mid_o, mid_lse, out, lse)
    if return_lse:
        assert lse is not None
        return out, lse
    return out


def _check_heads(hq: int, hkv: int, d: int, k_buffer: torch.Tensor) -> None:
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if k_buffer.shape[2] != d:
        raise ValueError(f"head dim mismatch: q has {d}, KV buffer has {k_buffer.shape[2]}")
    if k_buffer.stride(2) != 1:
        raise ValueError("KV buffer's last dimension must be contiguous")
