"""The torch reference of paged decode attention: one request at a time, fp32 math, K/V read
through req_to_token and dequantized. Promises: what `decode_attention` must equal, with the
log-sum-exp of each head's scores."""

from __future__ import annotations

import math

import torch

from .kv_quant import dequantize_kv


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    kv_start: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, one request at a time, fp32 math (or q's, if float64) → (out [B, Hq, D] in q's
    dtype, lse [B, Hq]); K/V rows dequantized with k_scale / v_scale [Hkv] (None = 1)."""
    bsz, hq, d = q.shape
    group = hq // k_buffer.shape[1]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros_like(q)
    lse = torch.full((bsz, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(bsz):
        lo = int(kv_start[b]) if kv_start is not None else 0
        hi = int(seq_lens[b])
        if hi <= lo:
            continue
        slots = req_to_token[int(req_pool_indices[b]), lo:hi]
        math_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        k = dequantize_kv(k_buffer[slots], k_scale, math_dtype).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = dequantize_kv(v_buffer[slots], v_scale, math_dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].to(math_dtype), k) * sm_scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out, lse
