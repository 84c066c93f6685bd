"""KV store: write the step's new K and V ([T, Hkv, D]) into the pool's per-layer buffers at
slots loc ([T]) in one launch. Promises: equals `kv_store_ref` (buffer[loc] = value, cast to
the buffer dtype); rows not in loc are untouched."""

from __future__ import annotations

import torch

from ._triton import next_pow2, tl, triton, use_triton


@triton.jit
def _kv_store_kernel(
    K, V, Kbuf, Vbuf, Loc, stride_kt, stride_vt, stride_bk, stride_bv, row_size, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_size
    slot = tl.load(Loc + t).to(tl.int64)
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(Kbuf + slot * stride_bk + offs, k.to(Kbuf.dtype.element_ty), mask=mask)
    tl.store(Vbuf + slot * stride_bv + offs, v.to(Vbuf.dtype.element_ty), mask=mask)


def kv_store(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buffer[loc] = k; v_buffer[loc] = v. k/v [T, Hkv, D]; buffers [S, Hkv, D] contiguous rows."""
    if k.shape != v.shape or k.shape[1:] != k_buffer.shape[1:] or loc.shape[0] != k.shape[0]:
        raise ValueError(
            f"kv_store shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"buffer {tuple(k_buffer.shape)}, loc {tuple(loc.shape)}"
        )
    if (
        k_buffer.stride(1) != k_buffer.shape[2]
        or k_buffer.stride(2) != 1
        or v_buffer.stride() != k_buffer.stride()
    ):
        raise ValueError("KV buffers need contiguous [Hkv, D] rows with equal strides")
    if not use_triton(k):
        kv_store_ref(k_buffer, v_buffer, loc, k, v)
        return
    t = k.shape[0]
    row = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(t, row), v.reshape(t, row)
    if k2.stride(-1) != 1 or v2.stride(-1) != 1:
        k2, v2 = k2.contiguous(), v2.contiguous()
    block = min(1024, next_pow2(row))
    if t:
        _kv_store_kernel[(t, triton.cdiv(row, block))](
            k2,
            v2,
            k_buffer,
            v_buffer,
            loc,
            k2.stride(0),
            v2.stride(0),
            k_buffer.stride(0),
            v_buffer.stride(0),
            row,
            BLOCK=block,
            num_warps=4,
        )


def kv_store_ref(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)
