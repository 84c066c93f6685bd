"""One launch each of the one-row matmul variants at one Llama-3.1-8B shape, between
cudaProfilerStart and Stop, so Nsight Compute reads their counters side by side (each variant
compiled and warmed before the profiled range; weights larger than L2 and cold).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats python3 benchmarks/ncu_one_row.py gate_up
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quant_gpu import SHAPES  # noqa: E402
from suite_quant import one_row_config  # noqa: E402

from radixlm.kernels.gemv import gemv  # noqa: E402
from radixlm.kernels.quant_blocks import quantize_blocks  # noqa: E402
from radixlm.kernels.quant_gemv import INT8_ROW_KINDS, quant_matmul, repack  # noqa: E402
from radixlm.kernels.quant_gemv_int8x import quantize_x_int8  # noqa: E402

VARIANTS = "Q4_0/dp4a:4:1024:4,Q4_0/int8x:4:1024:4,Q4_0/int8x:8:4096:4,Q8_0/dp4a:4:1024:4"


def launches(shape: str, variants: str) -> list[tuple[str, Callable[[], object]]]:
    n, k = SHAPES[shape]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    xq = quantize_x_int8(x)
    out: list[tuple[str, Callable[[], object]]] = [("bf16 gemv", lambda: gemv(x, w))]
    for item in variants.split(","):
        qtype, spec = item.split("/")
        kind, rows = spec.split(":", 1)
        cfg = one_row_config(kind, rows)
        q = repack(quantize_blocks(w, qtype), qtype)
        pre = xq if kind in INT8_ROW_KINDS else None  # the matmul alone, x rounded beforehand
        out.append(
            (f"{qtype} {cfg.label()}", lambda q=q, cfg=cfg, pre=pre: quant_matmul(x, q, cfg, x_int8=pre))
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument(
        "--variants", default=VARIANTS, help="comma list of qtype/kind:rows:block_k:warps[:stages]"
    )
    args = ap.parse_args()
    runs = launches(args.shape, args.variants)
    for _, fn in runs:  # compile and warm every variant first
        fn()
    flush = torch.empty(int(256e6), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, fn in runs:
        flush.zero_()  # L2 cold for each variant's weights
        print(f"profiled: {label}", flush=True)
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
