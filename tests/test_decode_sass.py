"""The fp8 decode kernel's machine code, compiled offline for sm_90 (Hopper) on any machine: with
V widened in registers no byte-wise shared-memory loads remain in it. Without that, Triton reads
the fp8 V tile from shared memory in the tensor cores' operand layout one byte at a time (the
control case below), which held the kernel far from the memory bound on the H200."""

from __future__ import annotations

from collections import Counter

import pytest
from sm90_sass import HAVE_NVDISASM, compile_sm90, opcodes

pytestmark = pytest.mark.skipif(not HAVE_NVDISASM, reason="triton ships no nvdisasm here")


def fp8_decode_signature(v_in_registers: bool) -> tuple[dict[str, str], dict[str, object]]:
    """_decode_partial_kernel's pointer types and constexprs for an fp8 pool, bf16 q, Llama-3
    heads (GQA 4, D 128), the default fp8 tile (128 keys), PDL on."""
    pointers = {
        "Q": "*bf16",
        "K": "*fp8e4nv",
        "V": "*fp8e4nv",
        "MidO": "*fp32",
        "MidLse": "*fp32",
        "Out": "*bf16",
    }
    for name in ("OutLse", "KScale", "VScale"):
        pointers[name] = "*fp32"
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
        DIRECT=False,
        WRITE_LSE=False,
        HAS_K_SCALE=False,
        HAS_V_SCALE=False,
        PDL=True,
    )
    return pointers, constexprs


def sass_opcodes(v_in_registers: bool) -> Counter[str]:
    """Opcode counts of _decode_partial_kernel as `fp8_decode_signature` has it, 4 warps, 3 stages."""
    from radixlm.kernels.decode_attention import _decode_partial_kernel as fn

    pointers, constexprs = fp8_decode_signature(v_in_registers)
    strides = tuple(name for name in fn.arg_names if name.startswith("stride"))
    sass = compile_sm90(
        fn,
        pointers,
        constexprs,
        num_warps=4,
        num_stages=3,
        aligned_ints=strides,
        floats=("sm_scale",),
    )
    return opcodes(sass)


def test_fp8_decode_reads_v_without_byte_loads() -> None:
    widened = sass_opcodes(True)
    assert widened["HMMA.16816.F32"] > 0  # the kernel compiled and its dots run on tensor cores
    assert widened["LDS.U8"] == 0, "the fp8 decode kernel reads shared memory byte-wise again"
    control = sass_opcodes(False)
    assert control["LDS.U8"] >= 64, (
        "Triton no longer reads the fp8 V tile byte-wise by itself: widen_v_in_registers may be unneeded"
    )
