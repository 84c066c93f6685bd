"""Triton import guard and dispatch rule shared by the kernel files. Promises: importing any
kernel module works without Triton (the `*_ref` torch functions stay usable); `use_triton(t)`
says whether an op on tensor `t` should launch its Triton kernel (CUDA, or the interpreter).
Every launch names `enable_fp_fusion` (Triton 3.10 turns its default off)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Shim:
        """Stands in for `triton` / `tl` so kernel definitions still parse; launching raises."""

        constexpr = Any

        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            def missing(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("triton is not installed; use the *_ref torch function")

            return missing if fn is not None else (lambda f: missing)

        def __getattr__(self, name: str) -> Any:
            return Any

    triton = _Shim()  # type: ignore[assignment]
    tl = _Shim()  # type: ignore[assignment]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _squeeze_interpreted_scalars() -> None:
    """Loop bounds read from memory (`range(lo, hi, BLOCK)`) reach Python's range through the
    interpreter's `tensor.__index__`. Triton 3.6's interpreter takes int() of the scalar's
    one-element array, which NumPy 2.4 refuses; later interpreters squeeze it first. Give the
    older ones the same conversion (the source check leaves any other interpreter untouched)."""
    import inspect

    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return
    try:
        unsqueezed = "int(self.handle.data))" in inspect.getsource(patch)
    except (OSError, TypeError):
        unsqueezed = False
    if not unsqueezed:
        return

    def patch_then_squeeze(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_then_squeeze


if HAS_TRITON and interpreting():
    _squeeze_interpreted_scalars()


_HAS_GDC = HAS_TRITON and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")

# The kernels that call `pdl_wait` first, by the names RADIXLM_PDL takes (their profiler names
# less the leading underscore and the `_kernel` suffix).
PDL_KERNELS = (
    "rmsnorm",
    "rotary",
    "decode_partial",
    "merge_splits",
    "silu_mul",
    "quantize_x",
    "gemv_int8x",
    "gemv_stream",
    "gemv_dp4a",
    "qkv_rope_store",
    "gemv_half2",
    "gemv_fma",
    "gemv_dot",
)


def pdl_kernels_from(value: str) -> frozenset[str]:
    """The kernels a RADIXLM_PDL value turns PDL on for: "0" or empty none, "1" all, else a
    comma-separated list of `PDL_KERNELS` names."""
    value = value.strip()
    if value in ("", "0"):
        return frozenset()
    if value == "1":
        return frozenset(PDL_KERNELS)
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = sorted(names - set(PDL_KERNELS))
    if unknown:
        raise ValueError(
            f"RADIXLM_PDL: unknown kernel(s) {', '.join(unknown)}; "
            f"give 0, 1 or a comma-separated list of {', '.join(PDL_KERNELS)}"
        )
    return frozenset(names)


PDL_ON = pdl_kernels_from(os.environ.get("RADIXLM_PDL", "1"))  # read once: pdl_args runs on every launch
# The PDL kernels that let the next one be placed right after their wait (its programs then queue
# on free SM slots while this one runs); the others release it only as their programs exit. The
# one-row quantized matmuls release late: early, they slowed batch-1 Q4_0 decode on an H100
# (0.93x), late with the rest early it ran 1.03x (benchmarks/results/pdl_h100.md).
PDL_EARLY: frozenset[str] = frozenset(PDL_KERNELS) - {
    "gemv_int8x",
    "gemv_stream",
    "gemv_dp4a",
    "qkv_rope_store",
    "gemv_half2",
}


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(t: torch.Tensor, kernel: str) -> dict[str, int | bool]:
    """Launch keywords for a `PDL_KERNELS` kernel, which calls `pdl_wait(PDL)` first, on tensor
    t's device: programmatic dependent launch (sm_90+, compiled, the kernel named in RADIXLM_PDL
    at import) lets the kernel's programs be placed while the kernel ahead of it drains, inside
    CUDA graphs too, hiding part of the gap between a decode step's many small launches. On
    unless RADIXLM_PDL=0: on an H100 it sped up batch-1 decode (bf16 1.026x, Q4_0 1.031x) and
    slowed none of the suite's engine workloads it was timed on
    (benchmarks/results/suite_ab_h100_pdl_default.md)."""
    on = (
        kernel in PDL_ON
        and _HAS_GDC
        and t.is_cuda
        and not interpreting()
        and _device_has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())
    )
    mode = (1 if kernel in PDL_EARLY else 2) if on else 0
    return {"PDL": mode, "launch_pdl": on}


if _HAS_GDC:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """First thing in a kernel launched with `pdl_args`: PDL 0 does nothing; otherwise wait
        until the kernel ahead has finished and its writes are visible (nothing is read or
        written before), then, for PDL 1, let the next kernel be placed at once (PDL 2 leaves
        that to the programs' exit)."""
        if PDL > 0:
            tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()

else:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        pass


def use_triton(t: torch.Tensor) -> bool:
    """Launch the Triton kernel for tensors on CUDA, or anywhere under the interpreter."""
    return HAS_TRITON and (t.is_cuda or interpreting())


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def split_block(num_splits: int) -> int:
    """BLOCK_S for a merge over num_splits partial states: a few fixed sizes rather than every
    power of two, so the per-step split count selects one of few compiled variants."""
    return 16 if num_splits <= 16 else 64 if num_splits <= 64 else next_pow2(num_splits)


def dot_precision(dtype: torch.dtype) -> str:
    """The DOT_PREC constexpr for `mma`: fp32 operands get exact products (tests); 16-bit
    operands run on tensor cores, or are upcast under the interpreter (its bf16 dot is broken:
    triton 3.9 multiplies the raw uint16 bit patterns)."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if interpreting() else "tf32"


@triton.jit
def mma(a, b, DOT_PREC: tl.constexpr):
    """tl.dot with fp32 accumulation; see dot_precision for DOT_PREC."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


def compiled_kernel_count() -> int:
    """Compiled variants of every radixlm Triton kernel loaded so far, over all devices. A kernel
    compiles once per distinct specialization (dtypes, constexprs, alignment): a count that grows
    while serving means compilation on the request path."""
    return sum(compiled_kernel_variants().values())


def compiled_kernel_variants() -> dict[str, int]:
    """Compiled variants by kernel ("module.function"), for the kernels that have any."""
    if not HAS_TRITON:
        return {}
    import sys

    from triton.runtime.jit import JITFunction

    out: dict[str, int] = {}
    seen: set[int] = set()  # a kernel imported by another module is still one kernel
    for name, module in list(sys.modules.items()):
        if not name.startswith("radixlm.kernels") or module is None:
            continue
        for attr, obj in list(vars(module).items()):
            if not isinstance(obj, JITFunction) or id(obj) in seen:
                continue
            seen.add(id(obj))
            n = sum(len(entry[0]) for entry in (getattr(obj, "device_caches", None) or {}).values())
            if n:
                out[f"{name.rsplit('.', 1)[-1]}.{attr}"] = n
    return out


__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "interpreting",
    "use_triton",
    "PDL_KERNELS",
    "pdl_args",
    "pdl_kernels_from",
    "pdl_wait",
    "next_pow2",
    "dot_precision",
    "mma",
    "compiled_kernel_count",
    "split_block",
]
