"""The per-layer pieces of CPU decode around the matmuls, each one C call in place of the 10-35
small torch ops it replaces (at batch 1 on the CPU a decode step is bound by the count of ops as
much as by the weights): residual add + RMSNorm of a few rows, and rope + KV store + attention
of one request's few new tokens (a decode token, or a verify step's token and drafts) over its
slots; and, for GGUF-block weights, every decoder layer of such a step as one call on a small
thread team (decode_layers, csrc/cpu_layers.c). Each row's arithmetic is the same however many
rows and threads come with it, so a verify step's rows equal the decode steps they stand for.
Built like radixlm.kernels.quant_gemv_cpu; `available()` is False where that cannot build, and
callers keep their torch ops."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from .quant_gemv_cpu import FORMATS, GEMV_MAX_ROWS, build_c

# Steps of up to as many rows as the GEMV kernel takes are bound by op count, like decode, and run
# these calls; larger ones (prefill) keep torch's batched, multi-threaded attention and norms.
MAX_ROWS = GEMV_MAX_ROWS

_CSRC = Path(__file__).parent / "csrc"
# one library: the layer loop calls the block matmul and the pieces above it directly
_SOURCE = "\n".join((_CSRC / f).read_text() for f in ("quant_gemv.c", "cpu_decode.c", "cpu_layers.c"))

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
                    lib.silu_mul.argtypes = [p, i, i, p]
                    lib.silu_mul.restype = None
                    lib.decode_layers.argtypes = [p, i, p, i, p, p, p, p, p, p, p, ctypes.c_int]
                    lib.decode_layers.restype = None
                    lib.matmul_threads.argtypes = [p, i, i, p, i, ctypes.c_int, p, ctypes.c_int]
                    lib.matmul_threads.restype = None
                _lib.append(lib)
    return _lib[0] is not None


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for float32 contiguous rows [m, n]; without
    a residual the plain norm (and x)."""
    lib = _lib[0]
    assert lib is not None
    total, h = torch.empty_like(x), torch.empty_like(x)
    m, n = x.shape
    res = None if residual is None else residual.data_ptr()
    lib.add_rmsnorm(x.data_ptr(), res, weight.data_ptr(), eps, m, n, total.data_ptr(), h.data_ptr())
    return h, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of float32 contiguous rows [m, 2 inter] (gate first) → [m, inter]."""
    lib = _lib[0]
    assert lib is not None and gate_up.dtype == torch.float32 and gate_up.is_contiguous()
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, inter)
    lib.silu_mul(gate_up.data_ptr(), m, inter, out.data_ptr())
    return out


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


def team_threads(limit: int) -> int:
    """Threads for a job of the C team: torch's intra-op count (the user's setting), at most limit.
    One where torch's OpenMP workers never leave the cores (OMP_WAIT_POLICY=active): the team's
    threads would wait on them at every barrier."""
    if os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "active":
        return 1
    return max(1, min(torch.get_num_threads(), limit))


class DecodeLayer(ctypes.Structure):
    """One layer's weights for decode_layers: RMSNorm weights (float32 [hidden]), the four
    projections as quant_gemv_cpu.repack() rows with their format index, the KV pool buffers."""

    _fields_ = [  # noqa: RUF012 (ctypes reads the class attribute)
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("qkv_fmt", ctypes.c_int32),
        ("o_fmt", ctypes.c_int32),
        ("gate_up_fmt", ctypes.c_int32),
        ("down_fmt", ctypes.c_int32),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
    ]


class DecodeShape(ctypes.Structure):
    _fields_ = [  # noqa: RUF012
        ("hidden", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("hq", ctypes.c_int64),
        ("hkv", ctypes.c_int64),
        ("d", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def format_index(qtype: str) -> int:
    return FORMATS.index(qtype)


def decode_layers(
    layers: ctypes.Array[DecodeLayer],
    shape: DecodeShape,
    h: torch.Tensor,
    residual: torch.Tensor,
    cos_rows: torch.Tensor,
    sin_signed_rows: torch.Tensor,
    new_slots: torch.Tensor,
    row_slots: list[int],
    row_lens: list[int],
    threads: int,
) -> None:
    """Every layer of n new tokens on `threads` threads, in place: h [n, hidden] (the embedding
    rows) becomes the last layer's output and residual the stream before it. Token i is stored at
    new_slots[i] and attends to the row_lens[i] int64 slots at address row_slots[i], itself last:
    one request's tokens share its slots with lengths prefix + 1, prefix + 2, ...; a decode batch
    gives each request's own. The tensors are float32 / int64 and contiguous; n <= MAX_ROWS."""
    lib = _lib[0]
    n = h.shape[0]
    assert lib is not None and h.is_contiguous() and residual.is_contiguous() and n <= MAX_ROWS
    assert (
        new_slots.dtype == torch.int64 and new_slots.is_contiguous() and len(row_slots) == len(row_lens) == n
    )
    assert cos_rows.is_contiguous() and sin_signed_rows.is_contiguous()
    lib.decode_layers(
        layers, len(layers), ctypes.byref(shape), n, cos_rows.data_ptr(), sin_signed_rows.data_ptr(),
        new_slots.data_ptr(), (ctypes.c_void_p * n)(*row_slots), (ctypes.c_int64 * n)(*row_lens),
        h.data_ptr(), residual.data_ptr(), threads,
    )  # fmt: skip


def gemm_threads(x: torch.Tensor, packed: torch.Tensor, qtype: str, rows: int, threads: int) -> torch.Tensor:
    """quant_gemv_cpu.gemm with the output columns shared by `threads` threads (the C team that
    decode_layers uses): the same bits, for a weight large enough to repay the hand-off."""
    lib = _lib[0]
    assert lib is not None and packed.is_contiguous() and x.shape[0] <= MAX_ROWS
    xf = x.to(torch.float32).contiguous()
    m, k = xf.shape
    y = torch.empty(m, rows)
    if m:  # no rows (a prompt chunk that needs no logits) is an empty result, not a kernel call
        lib.matmul_threads(
            xf.data_ptr(), m, k, packed.data_ptr(), rows, FORMATS.index(qtype), y.data_ptr(), threads
        )
    return y
