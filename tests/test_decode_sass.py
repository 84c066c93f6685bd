"""The fp8 decode kernel's machine code, compiled offline for sm_90 (Hopper) on any machine: with
V widened in registers no byte-wise shared-memory loads remain in it. Without that, Triton reads
the fp8 V tile from shared memory in the tensor cores' operand layout one byte at a time (the
control case below), which held the kernel far from the memory bound on the H200."""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
pytestmark = pytest.mark.skipif(not os.path.exists(NVDISASM), reason="triton ships no nvdisasm here")


def sass_opcodes(v_in_registers: bool, tmp_path) -> Counter[str]:
    """Opcode counts of _decode_partial_kernel for an fp8 pool, bf16 q, Llama-3 heads (GQA 4,
    D 128), the default fp8 tile (128 keys, 4 warps, 3 stages)."""
    from triton.backends.compiler import GPUTarget

    from radixlm.kernels.decode_attention import _decode_partial_kernel as fn

    pointers = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "MidO": "*fp32", "MidLse": "*fp32"}
    for name in ("ReqToToken", "ReqIdx", "SeqLens", "KvStart"):
        pointers[name] = "*i64"
    constexprs = dict(
        GROUP=4,
        HEAD_DIM=128,
        BLOCK_H=16,
        BLOCK_N=128,
        BLOCK_D=128,
        HAS_START=False,
        DOT_PREC="tf32",
        WIDEN_F16=True,
        V_IN_REGISTERS=v_in_registers,
    )
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers or name.startswith("stride"):
            signature[name] = pointers.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "sm_scale" else "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    cubin = tmp_path / f"decode_{v_in_registers}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([NVDISASM, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return Counter(ops)


def test_fp8_decode_reads_v_without_byte_loads(tmp_path) -> None:
    widened = sass_opcodes(True, tmp_path)
    assert widened["HMMA.16816.F32"] > 0  # the kernel compiled and its dots run on tensor cores
    assert widened["LDS.U8"] == 0, "the fp8 decode kernel reads shared memory byte-wise again"
    control = sass_opcodes(False, tmp_path)
    assert control["LDS.U8"] >= 64, (
        "Triton no longer reads the fp8 V tile byte-wise by itself: widen_v_in_registers may be unneeded"
    )
