"""The CPU matmul over GGUF blocks (Q4_0, Q4_1, Q8_0): a small C kernel built once with the
system C compiler for this CPU (cached by content) and called through ctypes. Weights keep their
block bytes, reordered by repack() and placed by arena() in one huge-page buffer in the order
decode reads them. Up to GEMV_MAX_ROWS rows of x per call (callers make several calls for up to
GEMV_PASSES_MAX_ROWS rows) take llama.cpp's integer path: activations quantized to int8 per block
of 32, int8 dot products, block scales applied in float. With AVX-512 VNNI repack() interleaves
the rows in groups of 16 (group_rows()), one dpbusd meets four x values with all sixteen and a
block's scale is one vector, every weight unpacked once for all rows of x; else rows stay whole
and AVX2 walks four side by side with software prefetch. A row of x gives the same bits whatever
rows come with it. More rows dequantize the blocks once per call (dense_dtype()) and run torch's
matmul. `available()` is False without a compiler or AVX2; callers then keep torch's packed int4
path."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

FORMATS = ("Q4_0", "Q4_1", "Q8_0")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# Rows per call of the C kernel (its per-thread scratch, MAXM in csrc/quant_gemv.c, holds 8).
# Speculation keeps a verify step within one call (fast_rows): each further call streams the
# weights again, a fixed cost on top of its rows' (benchmarks/results/cpu_batch_decode.md).
GEMV_MAX_ROWS = 8
# Up to this many rows a matmul runs the kernel in passes of GEMV_MAX_ROWS rows: each pass costs
# what its rows cost alone, where dequantizing the whole weight costs tens of ms per forward of
# the default model before the first row. With the 16-row groups the two meet near 192 rows of a
# prompt on a 2-core AVX-512 machine with bf16 matmuls (benchmarks/cpu_batch_decode.py); without
# bf16 matmuls the dense path is slower still.
GEMV_PASSES_MAX_ROWS = 192

_SOURCE = "\n".join(
    (Path(__file__).parent / "csrc" / f).read_text() for f in ("quant_gemv.c", "quant_dequant.c")
)

_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno", "-pthread"]
_lock = threading.Lock()
_lib: list[ctypes.CDLL | None] = []


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return torch.backends.cpu.get_cpu_capability()


def _cache_dir() -> Path:
    return Path(os.environ.get("RADIXLM_CACHE", Path.home() / ".cache" / "radixlm")) / "cpu_kernels"


def build_c(source: str, name: str) -> ctypes.CDLL | None:
    """source compiled with the system C compiler for this CPU and loaded; cached by content
    under ~/.cache/radixlm. None without AVX2 or without a working compiler."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    cc = os.environ.get("CC", "cc")
    # -march=native code is this CPU's: its flags are part of the key (a shared cache dir must not
    # hand one machine's build to another)
    key = hashlib.sha256((source + " ".join(_FLAGS) + cc + _cpu_flags()).encode()).hexdigest()[:16]
    so = _cache_dir() / f"{name}_{key}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
            src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
            src.write_text(source)
            try:
                subprocess.run(
                    [cc, *_FLAGS, str(src), "-o", str(out), "-lm"], check=True, capture_output=True
                )
            except (OSError, subprocess.CalledProcessError):
                return None
            os.replace(out, so)  # atomic: concurrent builders each install a whole file
    return ctypes.CDLL(str(so))


def _build() -> ctypes.CDLL | None:
    lib = build_c(_SOURCE, "quant_gemv")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.dequant_bf16.argtypes = [p, i, i, ctypes.c_int, p]
        lib.dequant_f32.argtypes = [p, i, i, ctypes.c_int, p]
        lib.matmul.argtypes = [p, i, i, p, i, ctypes.c_int, p]
        lib.matmul.restype = None
        lib.group_rows.argtypes = []
        lib.group_rows.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel is built (once per process; the .so is cached across processes)."""
    if not _lib:
        with _lock:
            if not _lib:
                _lib.append(None if os.environ.get("RADIXLM_NO_CPU_GEMV") else _build())
    return _lib[0] is not None


def supports(qtype: str, cols: int) -> bool:
    """Whether a [rows, cols] weight of this format runs here (the kernel's scale buffer caps K)."""
    return qtype in FORMATS and cols <= 16384 and available()


def group_rows() -> int:
    """Rows the kernel interleaves (16 with AVX-512 VNNI, else 1: rows kept whole)."""
    lib = _lib[0] if available() else None
    return int(lib.group_rows()) if lib is not None else 1


def repack(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks [rows, nb * bytes] → the kernel's layout, the same bytes reordered (plus zero
    rows up to a whole group). Rows kept whole: each row's nb scales (halves), for Q4_1 its nb
    offsets, then its quants. Groups of 16 rows (csrc/quant_gemv.c says why): per block, the 16
    scales, for Q4_1 the 16 offsets, then the quants as 4-byte pieces, piece c of every row in
    turn."""
    rows, nbytes = raw.shape[0], BLOCK_BYTES[qtype]
    b = raw.reshape(rows, -1, nbytes)
    head = 4 if qtype == "Q4_1" else 2
    g = group_rows()
    if g == 1:
        fields = [b[..., k : k + 2].reshape(rows, -1) for k in range(0, head, 2)]
        return torch.cat([*fields, b[..., head:].reshape(rows, -1)], dim=1).contiguous()
    if rows % g:  # zero rows: scale 0, so their outputs are 0 (the kernel stores none of them)
        b = torch.cat([b, b.new_zeros(g - rows % g, *b.shape[1:])])
    nb = b.shape[1]
    grouped = b.reshape(-1, g, nb, nbytes).transpose(1, 2)  # [groups, nb, 16 rows, bytes]
    fields = [grouped[..., k : k + 2].reshape(-1, nb, 2 * g) for k in range(0, head, 2)]
    q = grouped[..., head:].reshape(-1, nb, g, (nbytes - head) // 4, 4).transpose(2, 3)
    return torch.cat([*fields, q.reshape(-1, nb, (nbytes - head) * g)], dim=2).reshape(b.shape[0] // g, -1)


def arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors copied, in order, into one buffer advised to use transparent huge pages: decode
    streams every weight once per token, and with 4 KiB pages each page costs a TLB walk (about
    a fifth of the kernel's time on the default model). Views of the buffer are returned."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64  # 64-byte aligned starts
    buf = torch.empty(total + _HUGE, dtype=torch.uint8)
    start = -buf.data_ptr() % _HUGE
    _advise_huge(buf.data_ptr() + start, total // _HUGE * _HUGE)
    out = []
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        view = buf[start + off : start + off + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge(addr: int, length: int) -> None:
    """madvise(MADV_HUGEPAGE) before the pages are first touched; a no-op where unsupported."""
    if length <= 0:
        return
    try:
        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(addr, length, _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def gemm(x: torch.Tensor, packed: torch.Tensor, qtype: str, rows: int) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) @ W^T → float32 [M, rows], W as repack() laid it out."""
    lib = _lib[0]
    assert lib is not None and packed.is_contiguous() and x.shape[0] <= GEMV_MAX_ROWS
    xf = x.to(torch.float32).contiguous()
    m, k = xf.shape
    y = torch.empty(m, rows)
    if m:  # no rows (a prompt chunk that needs no logits) is an empty result, not a kernel call
        lib.matmul(xf.data_ptr(), m, k, packed.data_ptr(), rows, FORMATS.index(qtype), y.data_ptr())
    return y


@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype the many-row path dequantizes to and multiplies in: bf16 where the CPU has bf16
    dot products (AVX512-BF16, AMX), else fp32. Without them torch's bf16 matmul converts as it
    goes and runs about six times slower than fp32 (17-20 against 100-170 GFLOP/s at the
    default model's shapes on a 2-core AVX2 machine)."""
    flags = _cpu_flags().split()
    return torch.bfloat16 if "avx512_bf16" in flags or "amx_bf16" in flags else torch.float32


def dequantize(packed: torch.Tensor, qtype: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The repacked weight as dtype (bf16, or fp32 without rounding) [rows, cols]."""
    lib = _lib[0]
    assert lib is not None and packed.is_contiguous() and dtype in (torch.bfloat16, torch.float32)
    out = torch.empty(rows, cols, dtype=dtype)
    fill = lib.dequant_bf16 if dtype == torch.bfloat16 else lib.dequant_f32
    fill(packed.data_ptr(), rows, cols // 32, FORMATS.index(qtype), out.data_ptr())
    return out
