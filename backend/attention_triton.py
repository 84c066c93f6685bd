"""TritonAttentionBackend: the GPU attention path. Per layer it stores the step's new K/V into the
KV pool (one kernel), then runs split-K paged decode (or cascade decode when the batch carries a
CascadePlan in fb.cascade_plan) for decode batches, else paged extend attention. An fp8 pool is
quantized on store and read by the kernels with its per-head scales; extend reads the new tokens
back from the pool, so every token is attended as decode will later see it.
Promises: the same outputs as the torch reference backend up to rounding, no host sync."""

from __future__ import annotations

import math

import torch

from radixlm.kernels.cascade_attention import cascade_decode_attention
from radixlm.kernels.decode_attention import decode_attention
from radixlm.kernels.decode_splits import choose_decode_splits
from radixlm.kernels.extend_attention import extend_attention
from radixlm.kernels.kv_store import kv_store

from .forward_batch import ForwardBatch


class TritonAttentionBackend:
    """Implements the AttentionBackend protocol with radixlm.kernels."""

    def __init__(self, *, sm_scale: float | None = None, num_sms: int | None = None) -> None:
        self.sm_scale = sm_scale
        self._num_sms = num_sms

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
            )
        return self._num_sms

    def decode_splits(self, fb: ForwardBatch, num_kv_heads: int, device: torch.device) -> int:
        """Split count for the whole step (all layers), from host-side lengths only."""
        if fb.decode_num_splits is None:
            fb.decode_num_splits = choose_decode_splits(
                fb.batch_size,
                num_kv_heads,
                max(fb.seq_lens_cpu, default=1),
                self.num_sms(device),
                fb.kv_pool.dtype,
            )
        return fb.decode_num_splits

    supports_cascade = True
    accepts_stored_kv = True  # decode may pass k/v None: the model's rope kernel stored them
    supports_cuda_graphs = True  # lengths come from device tensors; host lists only size grids

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq * D] in q's dtype."""
        pool = fb.kv_pool
        k_buf, v_buf = pool.k_buffers[layer], pool.v_buffers[layer]
        if k is not None and v is not None:
            kv_store(k_buf, v_buf, fb.out_cache_loc, k, v, *pool.store_scales(layer))
        elif not fb.is_decode:
            raise ValueError("extend attention needs the new tokens' k and v")
        k_scale, v_scale = pool.scales(layer)  # None when 1: nothing to fold
        t, hq, d = q.shape
        dtype = q.dtype
        if not pool.quantized and q.dtype != k_buf.dtype:  # an fp8 pool is widened to q's dtype
            q = q.to(k_buf.dtype)
        q = q if q.stride(-1) == 1 else q.contiguous()
        scale = self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(d)
        if fb.is_decode:
            if fb.cascade_plan is not None:
                out = cascade_decode_attention(
                    q,
                    k_buf,
                    v_buf,
                    fb.req_to_token,
                    fb.req_pool_indices,
                    fb.seq_lens,
                    fb.cascade_plan,
                    scale,
                    shared_splits=fb.cascade_shared_splits,
                    own_splits=fb.cascade_own_splits,
                    k_scale=k_scale,
                    v_scale=v_scale,
                )
            else:
                out = decode_attention(
                    q,
                    k_buf,
                    v_buf,
                    fb.req_to_token,
                    fb.req_pool_indices,
                    fb.seq_lens,
                    scale,
                    num_splits=self.decode_splits(fb, k_buf.shape[1], q.device),
                    k_scale=k_scale,
                    v_scale=v_scale,
                )
        else:
            assert k is not None and v is not None
            if pool.quantized:  # the stored (quantized) rows, as decode will read them
                k, v = k_buf[fb.out_cache_loc], v_buf[fb.out_cache_loc]
            k, v = (x.to(k_buf.dtype) if x.dtype != k_buf.dtype else x for x in (k, v))
            k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
            out = extend_attention(
                q,
                k,
                v,
                k_buf,
                v_buf,
                fb.req_to_token,
                fb.req_pool_indices,
                fb.prefix_lens,
                fb.extend_lens,
                fb.extend_start_loc,
                max(fb.extend_lens_cpu, default=0),
                scale,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out.to(dtype).reshape(t, hq * d)
