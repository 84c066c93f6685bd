"""The one-row GGUF matmul kernels' machine code, compiled offline for sm_90 (Hopper) on any
machine. "int8x" reads x already rounded to int8 and holds whole blocks per thread: its loop
must keep no barrier and few instructions per `dp4a`. "dp4a", which rounds x inside every program,
is the control: its loop exchanges x through shared memory behind barriers and spends over
twice the instructions per `dp4a`, the cost "int8x" exists to remove."""

from __future__ import annotations

from collections import Counter

import pytest
from sm90_sass import HAVE_NVDISASM, compile_sm90, loop_opcodes

pytestmark = pytest.mark.skipif(not HAVE_NVDISASM, reason="triton ships no nvdisasm here")

KIND = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


def one_loop(kernel: str, qtype: str) -> Counter[str]:
    """The opcodes of the matmul loop of `kernel` ("int8x" or "dp4a") for qtype at its default
    config, bf16 x and y."""
    from radixlm.kernels.quant_gemv_configs import DP4A, INT8X

    cfg = INT8X if kernel == "int8x" else DP4A
    common = {"QW": "*i32", "D": "*fp16", "MN": "*fp16", "Y": "*bf16"}
    consts: dict[str, object] = dict(
        KIND=KIND[qtype], ROWS=cfg.block_n, BLOCK_B=cfg.block_k // 32, EVEN_B=True, ASM=True
    )
    if kernel == "int8x":
        from radixlm.kernels.quant_gemv_int8x import _gemv_int8x_kernel as fn

        pointers = {"XQ": "*i32", "XS": "*fp32", "XO": "*fp32", **common}
    else:
        from radixlm.kernels.quant_gemv_dp4a import _gemv_dp4a_kernel as fn

        pointers = {"X4": "*i64", **common}
        consts["X_F16"] = False
    sass = compile_sm90(
        fn, pointers, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned_ints=("N", "NB")
    )
    loops = loop_opcodes(sass)
    assert len(loops) == 1, f"{kernel} {qtype}: expected one loop, found {len(loops)}"
    return loops[0]


def per_dp4a(ops: Counter[str]) -> float:
    dots = sum(n for op, n in ops.items() if op.startswith("IDP.4A"))
    assert dots > 0, "the loop runs no dp4a: the inline PTX is gone"
    return sum(ops.values()) / dots


def barriers(ops: Counter[str]) -> int:
    return sum(n for op, n in ops.items() if op.startswith("BAR"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_int8x_loop_has_no_barrier_and_few_instructions(qtype: str) -> None:
    ops = one_loop("int8x", qtype)
    assert barriers(ops) == 0, f"int8x {qtype}: a barrier entered the loop: {ops.most_common(12)}"
    assert per_dp4a(ops) <= 8, f"int8x {qtype}: {per_dp4a(ops):.1f} instructions per dp4a"


def test_dp4a_control_pays_for_rounding_x_in_the_loop() -> None:
    ops = one_loop("dp4a", "Q4_0")
    assert barriers(ops) > 0 and per_dp4a(ops) > 2 * per_dp4a(one_loop("int8x", "Q4_0")), ops.most_common(12)
