"""Token bitmask → logits: set logits[b, t] = -inf where bit t of bitmask row b is 0 (xgrammar's
int32 layout, bit 1 = allowed). Promises: the Triton kernel and the torch reference agree exactly;
tokens past the bitmask width are masked, bitmask bits past the logits width are ignored."""

from __future__ import annotations

import numpy as np
import torch

try:  # triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def apply_token_bitmask_torch_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Reference (and CPU path): logits [B, V] float, bitmask [B', ceil(V/32)] int32, in place."""
    rows = logits if indices is None else logits[indices]
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).to(torch.bool)
    if allowed.shape[1] < vocab:
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    allowed = allowed[:, :vocab].to(logits.device)
    if indices is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[indices] = rows.masked_fill(~allowed, float("-inf"))


def unpack_bitmask_cpu(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """CPU bitmask [B, W] int32 → allowed bool [B, vocab] (numpy's unpackbits; bits past W*32 are 0)."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little").view(
        np.bool_
    )
    if bits.shape[1] < vocab:
        bits = np.concatenate(
            [bits, np.zeros((bits.shape[0], vocab - bits.shape[1]), dtype=np.bool_)], axis=1
        )
    return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab]))


def apply_token_bitmask_cpu_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """The CPU path: same result as the reference, unpacking with numpy."""
    forbidden = ~unpack_bitmask_cpu(bitmask, logits.shape[-1])
    if indices is None:
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits[indices] = logits[indices].masked_fill(forbidden, float("-inf"))


if triton is not None:

    @triton.jit
    def _apply_bitmask_kernel(
        logits_ptr,
        bitmask_ptr,
        indices_ptr,
        vocab,
        words,
        logits_stride,
        HAS_INDICES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_v = tl.program_id(1)
        row = pid_b
        if HAS_INDICES:
            row = tl.load(indices_ptr + pid_b)
        offs = pid_v * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offs < vocab
        word_idx = offs // 32
        in_mask = word_idx < words
        word = tl.load(bitmask_ptr + pid_b * words + word_idx, mask=in_vocab & in_mask, other=0)
        bit = (word >> (offs % 32)) & 1
        ptrs = logits_ptr + row * logits_stride + offs
        tl.store(
            ptrs,
            tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
            mask=in_vocab & (bit == 0),
        )


def apply_token_bitmask_triton_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None, block: int = 1024
) -> None:
    """Triton version: one program per (bitmask row, block of tokens); writes only masked slots."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if logits.stride(-1) != 1 or not bitmask.is_contiguous():
        raise ValueError("logits must have unit last stride and bitmask must be contiguous")
    batch, words = bitmask.shape
    vocab = logits.shape[-1]
    idx = indices if indices is not None else bitmask  # dummy pointer when unused
    grid = (batch, triton.cdiv(vocab, block))
    _apply_bitmask_kernel[grid](
        logits,
        bitmask,
        idx,
        vocab,
        words,
        logits.stride(0),
        HAS_INDICES=indices is not None,
        BLOCK=block,
        enable_fp_fusion=True,
    )
