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


class TorchAttentionBackend:
    """Stores the new K/V into the pool, then attends: new tokens see their request's cached
    prefix and, causally, each other."""

    supports_cascade = False  # attends per request: a cascade plan would change nothing
    accepts_stored_kv = False
    supports_cuda_graphs = False  # reads host-side lengths

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

    @staticmethod
    def _extend(
        q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, fb: ForwardBatch, sc: Scales = (None, None)
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for i, row in enumerate(fb.req_pool_indices_cpu):
            start, n = fb.extend_start_loc_cpu[i], fb.extend_lens_cpu[i]
            seq, prefix = fb.seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            slots = fb.req_to_token[row, :seq]
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ki = dequantize_kv(k_buf[slots], sc[0], q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, seq, D]
            vi = dequantize_kv(v_buf[slots], sc[1], q.dtype).transpose(0, 1).unsqueeze(0)
            if prefix == 0:  # plain causal: the kernel skips the masked half instead of reading a mask
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:
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
