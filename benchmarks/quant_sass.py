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
from sm90_sass import count, one_row_loop  # noqa: E402


def loop_counts(kernel: str, qtype: str, rows: int, block_k: int, warps: int) -> dict[str, object]:
    ops = one_row_loop(kernel, qtype, rows, block_k, warps)
    dots = count(ops, "IDP.4A")
    return {
        "instructions": sum(ops.values()),
        "dp4a": dots,
        "per_dp4a": round(sum(ops.values()) / dots, 1),
        "barriers": count(ops, "BAR"),
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
