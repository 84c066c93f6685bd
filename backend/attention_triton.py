"""TritonAttentionBackend: the GPU attention path. Per layer it stores the step's new K/V into the
KV pool (one kernel), then runs split-K paged decode (or cascade decode when the batch carries a
CascadePlan in fb.cascade_plan) for decode batches, else paged extend attention (a mixed step with
at least mixed_decode_min_rows leading decode rows runs those through decode attention). An fp8 pool is
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

from .forward_batch import ForwardBatch, MixedStepSplit, to_device_packed

# Fewest leading decode rows for which a mixed step runs them through decode attention
# (TritonAttentionBackend.mixed_split says why there is a floor); the suite's mixed_decode_split
# row measures the split against running the whole step through extend.
MIXED_DECODE_MIN_ROWS = 16


class TritonAttentionBackend:
    """Implements the AttentionBackend protocol with radixlm.kernels."""

    def __init__(
        self,
        *,
        sm_scale: float | None = None,
        num_sms: int | None = None,
        mixed_decode_min_rows: int | None = MIXED_DECODE_MIN_ROWS,
    ) -> None:
        """mixed_decode_min_rows: run a mixed step's leading decode rows through decode attention
        when there are at least this many (None: every mixed step runs as one extend)."""
        self.sm_scale = sm_scale
        self._num_sms = num_sms
        self.mixed_decode_min_rows = mixed_decode_min_rows

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
        t, hq, d = q.shape
        dtype = q.dtype
        if not pool.quantized and q.dtype != k_buf.dtype:  # an fp8 pool is widened to q's dtype
            q = q.to(k_buf.dtype)
        q = q if q.stride(-1) == 1 else q.contiguous()
        att = _LayerAttention(
            q, k_buf, v_buf, fb, layer, self.sm_scale if self.sm_scale is not None else 1.0 / math.sqrt(d)
        )
        if fb.is_decode:
            out = att.decode(self.decode_splits(fb, k_buf.shape[1], q.device))
        else:
            assert k is not None and v is not None
            split = self.mixed_split(fb, k_buf)
            out = att.extend(k, v) if split is None else att.mixed(k, v, split)
        return out.to(dtype).reshape(t, hq * d)

    def mixed_split(self, fb: ForwardBatch, k_buf: torch.Tensor) -> MixedStepSplit | None:
        """Whether a mixed step's leading decode items (one new token each, where the planner puts
        them) run through decode attention: the extend kernel gives each such row a whole
        BLOCK_M tile and reads its prefix in one unsplit program, and its grid, sized by the
        step's longest prompt chunk, is mostly programs that exit at once. mixed_decode_min_rows
        keeps the decode part's extra launches (host time in an eager step) to steps with enough
        decode rows to repay them."""
        if not fb.mixed_split_decided:
            fb.mixed_split_decided = True
            ext = fb.extend_lens_cpu
            rows = next((i for i, n in enumerate(ext) if n != 1), len(ext))
            least = self.mixed_decode_min_rows
            if least is not None and least <= rows < len(ext):
                fb.mixed_split = self._split(fb, rows, k_buf)
        return fb.mixed_split

    def _split(self, fb: ForwardBatch, rows: int, k_buf: torch.Tensor) -> MixedStepSplit:
        starts = fb.extend_start_loc_cpu
        ext_rows, prefix, ext, ext_starts = to_device_packed(
            [
                fb.req_pool_indices_cpu[rows:],
                fb.prefix_lens_cpu[rows:],
                fb.extend_lens_cpu[rows:],
                [s - starts[rows] for s in starts[rows:]],
            ],
            k_buf.device,
        )
        splits = choose_decode_splits(
            rows, k_buf.shape[1], max(fb.seq_lens_cpu[:rows]), self.num_sms(k_buf.device), k_buf.dtype
        )
        return MixedStepSplit(rows, splits, ext_rows, prefix, ext, ext_starts, max(fb.extend_lens_cpu[rows:]))


class _LayerAttention:
    """One layer's attention call over the pool's buffers: decode, extend, or a mixed step's two
    parts written into one output."""

    def __init__(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        fb: ForwardBatch,
        layer: int,
        scale: float,
    ) -> None:
        self.q, self.k_buf, self.v_buf, self.fb, self.scale = q, k_buf, v_buf, fb, scale
        self.k_scale, self.v_scale = fb.kv_pool.scales(layer)  # None when 1: nothing to fold

    def decode(self, num_splits: int) -> torch.Tensor:
        fb = self.fb
        if fb.cascade_plan is not None:
            return cascade_decode_attention(
                self.q,
                self.k_buf,
                self.v_buf,
                fb.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                fb.cascade_plan,
                self.scale,
                shared_splits=fb.cascade_shared_splits,
                own_splits=fb.cascade_own_splits,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
        return self._decode_rows(self.q, fb.req_pool_indices, fb.seq_lens, num_splits)

    def _decode_rows(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        num_splits: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return decode_attention(
            q,
            self.k_buf,
            self.v_buf,
            self.fb.req_to_token,
            rows,
            seq_lens,
            self.scale,
            num_splits=num_splits,
            out=out,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def extend(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        split: MixedStepSplit | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every item through extend attention, or with split only those after its decode rows;
        a quantized pool's new rows are read back as stored, as decode will see them."""
        fb = self.fb
        t0 = fb.extend_start_loc_cpu[split.decode_rows] if split is not None else 0
        if fb.kv_pool.quantized:
            loc = fb.out_cache_loc[t0:]
            k, v = self.k_buf[loc], self.v_buf[loc]
        else:
            k, v = k[t0:], v[t0:]
        k, v = (x.to(self.k_buf.dtype) if x.dtype != self.k_buf.dtype else x for x in (k, v))
        k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
        items = (
            (
                split.req_pool_indices,
                split.prefix_lens,
                split.extend_lens,
                split.extend_start_loc,
                split.max_extend_len,
            )
            if split is not None
            else (
                fb.req_pool_indices,
                fb.prefix_lens,
                fb.extend_lens,
                fb.extend_start_loc,
                max(fb.extend_lens_cpu, default=0),
            )
        )
        return extend_attention(
            self.q[t0:],
            k,
            v,
            self.k_buf,
            self.v_buf,
            fb.req_to_token,
            *items,
            self.scale,
            out=out,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def mixed(self, k: torch.Tensor, v: torch.Tensor, split: MixedStepSplit) -> torch.Tensor:
        """The decode rows, then the extend items, each written into its rows of one output."""
        n, fb = split.decode_rows, self.fb
        out = torch.empty(self.q.shape, dtype=self.q.dtype, device=self.q.device)
        self._decode_rows(self.q[:n], fb.req_pool_indices[:n], fb.seq_lens[:n], split.num_splits, out[:n])
        self.extend(k, v, split, out[n:])
        return out
