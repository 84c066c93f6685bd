"""TorchAttentionBackend: the reference attention through the page table, in plain torch ops.
It is the CPU path and the yardstick the Triton kernels are tested against; it runs correctly
(if not fast) on any device. An fp8 pool is quantized by KVPool.store and dequantized (times its
per-head scales) as rows are gathered."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.kv_quant import dequantize_kv

from .forward_batch import ForwardBatch

Scales = tuple[torch.Tensor | None, torch.Tensor | None]

# Fewest new tokens for which an extend over a cached prefix attends the prefix and its own tokens
# apart (prefix_then_causal) rather than through one SDPA over a bottom-right causal mask: the
# split builds no mask and skips the masked half of the new tokens' square, but costs a second
# kernel call and a merge, which only larger extends repay (benchmarks/cpu_prefill.py).
PREFIX_SPLIT_MIN_TOKENS = 512


class TorchAttentionBackend:
    """Stores the new K/V into the pool, then attends: new tokens see their request's cached
    prefix and, causally, each other."""

    supports_cascade = False  # attends per request: a cascade plan would change nothing
    accepts_stored_kv = False
    supports_cuda_graphs = False  # reads host-side lengths

    def __init__(self, prefix_split_min_tokens: int | None = PREFIX_SPLIT_MIN_TOKENS) -> None:
        """prefix_split_min_tokens: extends over a cached prefix with at least this many new
        tokens take prefix_then_causal on the CPU (None: never)."""
        self.prefix_split_min_tokens = prefix_split_min_tokens

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int, fb: ForwardBatch
    ) -> torch.Tensor:
        if k is None or v is None:  # accepts_stored_kv is False: the model hands this path K and V
            raise ValueError("the torch attention path stores the step's K/V itself: pass k and v")
        fb.kv_pool.store(layer, fb.out_cache_loc, k, v)
        k_buf, v_buf = fb.kv_pool.k_buffers[layer], fb.kv_pool.v_buffers[layer]
        sc = fb.kv_pool.scales(layer)
        if fb.is_decode and fb.batch_size == 1:
            out = self._decode_one(q, k_buf, v_buf, fb, sc)
        elif fb.is_decode:
            out = self._decode(q, k_buf, v_buf, fb, sc)
        else:
            out = self._extend(q, k_buf, v_buf, fb, sc)
        return out.reshape(q.shape[0], -1)

    def _extend(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        fb: ForwardBatch,
        sc: Scales = (None, None),
    ) -> torch.Tensor:
        least = self.prefix_split_min_tokens
        out = torch.empty_like(q)
        for i, row in enumerate(fb.req_pool_indices_cpu):
            start, n = fb.extend_start_loc_cpu[i], fb.extend_lens_cpu[i]
            seq, prefix = fb.seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            slots = fb.req_to_token[row, :seq]
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ki = dequantize_kv(k_buf[slots], sc[0], q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, seq, D]
            vi = dequantize_kv(v_buf[slots], sc[1], q.dtype).transpose(0, 1).unsqueeze(0)
            o = None
            if prefix == 0:  # plain causal: the kernel skips the masked half instead of reading a mask
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            elif least is not None and n >= least:
                o = prefix_then_causal(qi, ki, vi, prefix)
            if o is None:
                key_pos = torch.arange(seq, device=q.device)
                query_pos = torch.arange(prefix, seq, device=q.device)
                mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [n, seq]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode_one(
        q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, fb: ForwardBatch, sc: Scales = (None, None)
    ) -> torch.Tensor:
        """One request: its slots are one row of the table, so no padding mask (CPU decode is
        bound by the count of small ops)."""
        slots = fb.req_to_token[fb.req_pool_indices_cpu[0], : fb.seq_lens_cpu[0]]
        kb = dequantize_kv(k_buf.index_select(0, slots), sc[0], q.dtype).transpose(0, 1).unsqueeze(0)
        vb = dequantize_kv(v_buf.index_select(0, slots), sc[1], q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kb, vb, enable_gqa=True)
        return o.squeeze(2)

    @staticmethod
    def _decode(
        q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, fb: ForwardBatch, sc: Scales = (None, None)
    ) -> torch.Tensor:
        max_len = max(fb.seq_lens_cpu)
        slots = fb.req_to_token[fb.req_pool_indices, :max_len]  # [B, L]
        valid = torch.arange(max_len, device=q.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        kb = dequantize_kv(k_buf[slots], sc[0], q.dtype).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        vb = dequantize_kv(v_buf[slots], sc[1], q.dtype).permute(0, 2, 1, 3)
        qb = q.unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=valid[:, None, None, :], enable_gqa=True)
        return o.squeeze(2)


def prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor | None:
    """Attention of n new queries q [1, Hq, n, D] over k, v [1, Hkv, prefix + n, D] (query i sees
    keys up to prefix + i): the prefix unmasked, the new tokens with is_causal, each through torch's
    CPU flash kernel, merged by their log-sum-exp. None off the CPU or where this torch lacks the
    kernel's entry point (callers then take the masked SDPA)."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or q.device.type != "cpu":
        return None
    _, hq, n, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    # each KV head's query heads side by side as one longer query: the prefix part has no mask,
    # so the rows need not stay apart
    o_pre, lse_pre = flash(q.reshape(1, hkv, group * n, d), k[:, :, :prefix], v[:, :, :prefix])
    k_new = k[:, :, prefix:].repeat_interleave(group, 1)
    v_new = v[:, :, prefix:].repeat_interleave(group, 1)
    o_new, lse_new = flash(q, k_new, v_new, is_causal=True)
    lse_pre = lse_pre.reshape(1, hq, n, 1)
    lse_new = lse_new.reshape(1, hq, n, 1)
    top = torch.maximum(lse_pre, lse_new)
    w_pre, w_new = torch.exp(lse_pre - top), torch.exp(lse_new - top)
    merged: torch.Tensor = (o_pre.reshape(1, hq, n, d).float() * w_pre + o_new.float() * w_new) / (
        w_pre + w_new
    )
    return merged.to(q.dtype)
