"""The one-row GGUF matmul kernels ("int8x", "dp4a") compiled offline for sm_90 at given configs,
on any machine (Triton's ptxas and nvdisasm, through tests/sm90_sass.py): per config the loop's
instructions, dp4a count, instructions per dp4a, barriers and loads, the machine-code side of a
config sweep before a GPU times it.

    python benchmarks/quant_sass.py int8x:Q4_0:8:4096:4 dp4a:Q4_0:4:1024:4
    (kind:format:rows:block_k:warps)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sm90_sass import compile_sm90, loop_opcodes  # noqa: E402

KIND = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


def loop_counts(kernel: str, qtype: str, rows: int, block_k: int, warps: int) -> dict[str, object]:
    common = {"QW": "*i32", "D": "*fp16", "MN": "*fp16", "Y": "*bf16"}
    consts: dict[str, object] = dict(
        KIND=KIND[qtype], ROWS=rows, BLOCK_B=block_k // 32, EVEN_B=True, ASM=True
    )
    if kernel == "int8x":
        from radixlm.kernels.quant_gemv_int8x import _gemv_int8x_kernel as fn

        pointers = {"XQ": "*i32", "XS": "*fp32", "XO": "*fp32", **common}
    else:
        from radixlm.kernels.quant_gemv_dp4a import _gemv_dp4a_kernel as fn

        pointers = {"X4": "*i64", **common}
        consts["X_F16"] = False
    sass = compile_sm90(fn, pointers, consts, num_warps=warps, num_stages=1, aligned_ints=("N", "NB"))
    (ops,) = loop_opcodes(sass)
    dots = sum(n for op, n in ops.items() if op.startswith("IDP"))
    return {
        "instructions": sum(ops.values()),
        "dp4a": dots,
        "per_dp4a": round(sum(ops.values()) / dots, 1),
        "barriers": sum(n for op, n in ops.items() if op.startswith("BAR")),
        "loads": {op: n for op, n in sorted(ops.items()) if op.startswith("LD")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", help="kind:format:rows:block_k:warps")
    for spec in p.parse_args().configs:
        kind, qtype, *nums = spec.split(":")
        rows, block_k, warps = (int(v) for v in nums)
        print(spec, loop_counts(kind, qtype, rows, block_k, warps), flush=True)


if __name__ == "__main__":
    main()
