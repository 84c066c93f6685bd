"""The per-layer pieces of CPU decode around the matmuls, each one C call in place of the 10-35
small torch ops it replaces (at batch 1 on the CPU a decode step is bound by the count of ops as
much as by the weights): residual add + RMSNorm of a few rows, and rope + KV store + attention
of one request's few new tokens (a decode token, or a verify step's token and drafts) over its
slots. Each row's arithmetic is the same however many rows come with it, so a verify step's
rows equal the decode steps they stand for. Built like radixlm.kernels.quant_gemv_cpu;
`available()` is False where that cannot build, and callers keep their torch ops."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from .quant_gemv_cpu import GEMV_MAX_ROWS, build_c

# Steps of up to as many rows as the GEMV kernel takes are bound by op count, like decode, and run
# these calls; larger ones (prefill) keep torch's batched, multi-threaded attention and norms.
MAX_ROWS = GEMV_MAX_ROWS

_SOURCE = (Path(__file__).parent / "csrc" / "cpu_decode.c").read_text()

_lock = threading.Lock()
_lib: list[ctypes.CDLL | None] = []


def available() -> bool:
    if not _lib:
        with _lock:
            if not _lib:
                lib = None if os.environ.get("RADIXLM_NO_CPU_GEMV") else build_c(_SOURCE, "cpu_decode")
                if lib is not None:
                    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
                    lib.add_rmsnorm.argtypes = [p, p, p, f, i, i, p, p]
                    lib.add_rmsnorm.restype = None
                    lib.rope_store_attend.argtypes = [p, i, i, i, i, p, p, p, p, p, p, i, f, p]
                    lib.rope_store_attend.restype = None
                _lib.append(lib)
    return _lib[0] is not None


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for float32 contiguous rows [m, n]."""
    lib = _lib[0]
    assert lib is not None
    total, h = torch.empty_like(residual), torch.empty_like(residual)
    m, n = residual.shape
    lib.add_rmsnorm(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, m, n, total.data_ptr(), h.data_ptr()
    )
    return h, total


def rope_store_attend(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    cos_rows: torch.Tensor,
    sin_signed_rows: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    new_slots: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The attention output [n, hq * d] (float32) of one request's n new tokens (qkv [n, ...],
    cos/sin rows [n, d] at their positions), their k and v stored at new_slots (int64 [n]);
    slots (int64) are the request's KV slots, the n new ones last."""
    lib = _lib[0]
    assert lib is not None and new_slots.dtype == slots.dtype == torch.int64
    assert new_slots.is_contiguous() and slots.is_contiguous() and cos_rows.is_contiguous()
    hq, hkv, d = heads
    n = qkv.shape[0]
    out = torch.empty(n, hq * d)
    lib.rope_store_attend(
        qkv.data_ptr(), n, hq, hkv, d, cos_rows.data_ptr(), sin_signed_rows.data_ptr(),
        k_buf.data_ptr(), v_buf.data_ptr(), new_slots.data_ptr(), slots.data_ptr(), slots.numel() - n,
        d**-0.5, out.data_ptr(),
    )  # fmt: skip
    return out
