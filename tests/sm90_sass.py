"""Triton kernels compiled for sm_90 (Hopper) on any machine, with Triton's own ptxas and nvdisasm:
opcode counts of the whole kernel and of its loops (the one-row GGUF matmuls' at given tiles), so
tests can hold a kernel's machine code to what its design promises without a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
HAVE_NVDISASM = os.path.exists(os.path.join(BIN, "nvdisasm"))
_INSTR = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def compile_sm90(
    fn: object,
    pointers: dict[str, str],
    constexprs: dict[str, object],
    *,
    num_warps: int,
    num_stages: int,
    aligned_ints: tuple[str, ...] = (),
    floats: tuple[str, ...] = (),
) -> str:
    """fn's SASS for sm_90: pointers (name → Triton type) and the ints named in aligned_ints
    marked divisible by 16, as the launcher specialises them for aligned tensors and sizes;
    other arguments are i32, or fp32 where floats names them; FP fusion on, as the launches
    name it (those that turn it off round values, which these checks do not look at)."""
    from triton.backends.compiler import GPUTarget

    names: list[str] = fn.arg_names  # type: ignore[attr-defined]
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = pointers.get(name, "i32")
            if name in pointers or name in aligned_ints:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        return subprocess.run(
            [os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
        ).stdout


def opcodes(sass: str) -> Counter[str]:
    return Counter(m.group(2) for m in _INSTR.finditer(sass))


def count(ops: Counter[str], prefix: str) -> int:
    """Instructions whose opcode starts with prefix ("BAR": barriers, "IDP.4A": dp4a)."""
    return sum(n for op, n in ops.items() if op.startswith(prefix))


def loop_opcodes(sass: str) -> list[Counter[str]]:
    """Opcode counts of each loop: the instructions from a label to a branch back to it."""
    instrs: list[tuple[int, str, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTR.search(line)
        if m:
            addr = int(m.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            instrs.append((addr, m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in instrs:
        target = re.search(r"\((\.L_x_\d+)\)", rest) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), addr) < addr:
            start = labels[target.group(1)]
            loops.append(Counter(o for a, o, _ in instrs if start <= a <= addr))
    return loops


def one_row_loop(
    kernel: str, qtype: str, rows: int, block_k: int, warps: int, stages: int = 1, x_whole: bool = False
) -> Counter[str]:
    """The opcodes of the loop of a one-row GGUF matmul kernel ("int8x", "dp4a" or "stream") for
    qtype at the given tiles, bf16 x and y, K a multiple of the block step ("stream": one tile
    spanning K where x_whole)."""
    from radixlm.kernels.quant_gemv_dp4a import FORMAT_KIND

    common = {"QW": "*i32", "D": "*fp16", "MN": "*fp16", "Y": "*bf16"}
    consts: dict[str, object] = dict(
        KIND=FORMAT_KIND[qtype], ROWS=rows, BLOCK_B=block_k // 32, EVEN_B=True, ASM=True, PDL=True
    )
    if kernel == "int8x":
        from radixlm.kernels.quant_gemv_int8x import _gemv_int8x_kernel as fn

        pointers = {"XQ": "*i32", "XS": "*fp32", "XO": "*fp32", **common}
    elif kernel == "stream":
        from radixlm.kernels.quant_gemv_stream import _gemv_stream_kernel as fn

        pointers = {"XQ": "*i32", "XS": "*fp32", "XO": "*fp32", **common}
        consts.update(X_WHOLE=x_whole, STAGES=stages)
    else:
        from radixlm.kernels.quant_gemv_dp4a import _gemv_dp4a_kernel as fn

        pointers = {"X4": "*i64", **common}
        consts["X_F16"] = False
    sass = compile_sm90(fn, pointers, consts, num_warps=warps, num_stages=stages, aligned_ints=("N", "NB"))
    loops = loop_opcodes(sass)
    assert len(loops) == 1, f"{kernel} {qtype}: expected one loop, found {len(loops)}"
    return loops[0]
