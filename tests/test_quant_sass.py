"""The one-row GGUF matmul kernels' machine code, compiled offline for sm_90 (Hopper) on any
machine. "int8x" reads x already rounded to int8 and holds whole blocks per thread: its loop
must keep no barrier and few instructions per `dp4a`. "dp4a", which rounds x inside every program,
is the control: its loop exchanges x through shared memory behind barriers and spends over
twice the instructions per `dp4a`, the cost "int8x" exists to remove. "stream" with one tile
spanning K pipelines the weights alone: asynchronous copies to shared memory, no load that waits
in the loop, x read before it."""

from __future__ import annotations

from collections import Counter

import pytest
from sm90_sass import HAVE_NVDISASM, count, one_row_loop

pytestmark = pytest.mark.skipif(not HAVE_NVDISASM, reason="triton ships no nvdisasm here")


def one_loop(kernel: str, qtype: str) -> Counter[str]:
    """The opcodes of the matmul loop of `kernel` ("int8x" or "dp4a") for qtype at its default
    config."""
    from radixlm.kernels.quant_gemv_configs import DP4A, INT8X

    cfg = INT8X if kernel == "int8x" else DP4A
    return one_row_loop(kernel, qtype, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)


def per_dp4a(ops: Counter[str]) -> float:
    dots = count(ops, "IDP.4A")
    assert dots > 0, "the loop runs no dp4a: the inline PTX is gone"
    return sum(ops.values()) / dots


def barriers(ops: Counter[str]) -> int:
    return count(ops, "BAR")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_int8x_loop_has_no_barrier_and_few_instructions(qtype: str) -> None:
    ops = one_loop("int8x", qtype)
    assert barriers(ops) == 0, f"int8x {qtype}: a barrier entered the loop: {ops.most_common(12)}"
    assert per_dp4a(ops) <= 8, f"int8x {qtype}: {per_dp4a(ops):.1f} instructions per dp4a"


def test_dp4a_control_pays_for_rounding_x_in_the_loop() -> None:
    ops = one_loop("dp4a", "Q4_0")
    assert barriers(ops) > 0 and per_dp4a(ops) > 2 * per_dp4a(one_loop("int8x", "Q4_0")), ops.most_common(12)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_stream_loop_copies_weights_ahead_and_reads_x_once(qtype: str) -> None:
    """1 row x 4,096 values x 1 warp (K = 4,096: one tile spans K): at 2 stages the loop's global
    reads are asynchronous copies of the weight tile alone (a 16-byte copy per block a thread
    holds, two for Q8_0), none a load that waits; at 1 stage Triton pipelines nothing."""
    from radixlm.kernels.quant_gemv_dp4a import FORMAT_KIND

    piped = one_row_loop("stream", qtype, 1, 4096, 1, 2, x_whole=True)
    per_thread = 4096 // 32 // 32 * (2 if FORMAT_KIND[qtype] == 2 else 1)
    assert count(piped, "LDG.E") == 0, piped.most_common(12)
    assert count(piped, "LDGSTS.E.BYPASS.128") == per_thread, piped.most_common(12)
    assert count(one_row_loop("stream", qtype, 1, 4096, 1, 1, x_whole=True), "LDGSTS") == 0
