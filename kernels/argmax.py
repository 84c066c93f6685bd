"""Greedy token choice: the index of each row's largest logit, in two launches (per-chunk maxima
across the GPU, then one program per row over its chunks), where torch's one-row argmax runs in a
single block. Promises: `argmax_rows(x)` equals `torch.argmax(x, dim=-1)`, ties and NaN included
(the first maximum wins; a NaN counts as the maximum)."""

from __future__ import annotations

import torch

from ._triton import next_pow2, tl, triton, use_triton

# Logits per program of the first stage: a 128K vocabulary row spreads over 32 programs
_CHUNK = 4096


@triton.jit
def _block_max(x, mask, BLOCK: tl.constexpr):
    """(the block's maximum, its first position in the block): NaN wins over any number, the
    first NaN over later ones."""
    pos = tl.arange(0, BLOCK)
    nan = (x != x) & mask
    first_nan = tl.min(tl.where(nan, pos, BLOCK), axis=0)
    numbers = tl.where(mask & (x == x), x, float("-inf"))
    has_nan = first_nan < BLOCK
    top = tl.max(numbers, axis=0)
    first_top = tl.min(tl.where(mask & (numbers == top), pos, BLOCK), axis=0)
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)


@triton.jit
def _argmax_chunks_kernel(X, Vals, Idx, n_cols, stride_x, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    value, pos = _block_max(x, mask, CHUNK)
    tl.store(Vals + row * num_chunks + chunk, value)
    tl.store(Idx + row * num_chunks + chunk, chunk * CHUNK + pos)


@triton.jit
def _argmax_rows_kernel(Vals, Idx, Out, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    vals = tl.load(Vals + row * num_chunks + offs, mask=mask, other=float("-inf"))
    # chunks are in column order: the first chunk holding the maximum holds its first index
    _, chunk = _block_max(vals, mask, BLOCK_C)
    tl.store(Out + row, tl.load(Idx + row * num_chunks + chunk).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] float (last dimension contiguous) → [N] int64, the index of each row's maximum."""
    if x.dim() != 2:
        raise ValueError(f"argmax_rows takes [rows, columns], not shape {tuple(x.shape)}")
    n, v = x.shape
    wide = x.dtype not in (torch.float32, torch.bfloat16, torch.float16)  # float64: no fp32 rounding
    if not use_triton(x) or wide or n == 0 or v == 0 or x.stride(1) != 1:
        return torch.argmax(x, dim=-1)
    chunks = triton.cdiv(v, _CHUNK)
    vals = torch.empty((n, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    _argmax_chunks_kernel[(n, chunks)](
        x, vals, idx, v, x.stride(0), chunks, CHUNK=_CHUNK, num_warps=8, enable_fp_fusion=True
    )
    _argmax_rows_kernel[(n,)](
        vals, idx, out, chunks, BLOCK_C=max(16, next_pow2(chunks)), num_warps=1, enable_fp_fusion=True
    )
    return out
