"""GPU matmul over GGUF blocks (radixlm.kernels.quant_gemv) at the Llama-3.1-8B linear shapes,
beside bf16 (cuBLAS F.linear, and radixlm's own GEMV for one row) in the same run: time per call
with launch cost hidden (CUDA graphs of 40 calls), weights rotated over copies larger than L2,
the bytes moved per second, and a sweep of kernel configs per row count with the fastest named.

    python benchmarks/quant_gpu.py --out benchmarks/results/quant_gpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_env import environment, write_result  # noqa: E402
from kernels_common import L2_BYTES, time_fn  # noqa: E402
from suite_quant import one_row_config  # noqa: E402

from radixlm.kernels.gemv import gemv  # noqa: E402
from radixlm.kernels.quant_blocks import quantize_blocks  # noqa: E402
from radixlm.kernels.quant_gemv import (
    DEFAULTS,
    HALF2_FORMATS,
    INT8_ROW_KINDS,
    QuantMatmulConfig,
    choose_config,
    default_config,
    dequantize,
    quant_matmul,
    repack,
)  # noqa: E402
from radixlm.kernels.quant_gemv_configs import LONG_K  # noqa: E402
from radixlm.kernels.quant_gemv_int8x import quantize_x_int8  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ACC = [
    QuantMatmulConfig("acc", n, k, w, magic=magic)
    for n, k, w in [
        (2, 1024, 4),
        (4, 1024, 4),
        (4, 512, 4),
        (8, 512, 4),
        (2, 2048, 4),
        (4, 2048, 8),
        (8, 1024, 8),
        (16, 256, 4),
    ]
    for magic in (False, True)
]
HALF2 = [
    QuantMatmulConfig("half2", rows, k, w)
    for rows in (8, 16, 32)
    for k, w in [(512, 1), (1024, 1), (512, 2), (1024, 2), (2048, 2), (2048, 4), (4096, 4)]
]
DP4A_KW = [(256, 1), (512, 1), (512, 2), (1024, 2), (1024, 4), (2048, 4), (4096, 4)]


def dp4a_configs(rows: tuple[int, ...]) -> list[QuantMatmulConfig]:
    return [
        QuantMatmulConfig("dp4a", r, k, w, num_stages=s) for r in rows for k, w in DP4A_KW for s in (1, 3)
    ]


DP4A = dp4a_configs((4, 8, 16, 32))
# rows x blocks per K tile over the threads: one block per thread (the first eight) or two; one
# stage only: Triton does not pipeline these loads (their sm_90 loops are alike at 1 and 3 stages)
INT8X = [
    QuantMatmulConfig("int8x", r, k, w)
    for r, k, w in [
        (2, 2048, 4),
        (4, 1024, 4),
        (8, 512, 4),
        (16, 256, 4),
        (4, 512, 2),
        (8, 256, 2),
        (4, 2048, 8),
        (8, 1024, 8),
        (4, 2048, 4),
        (8, 1024, 4),
    ]
]
FMA = [
    QuantMatmulConfig("fma", n, k, w, magic=magic)
    for n, k, w, magic in [
        (2, 1024, 4, False),
        (4, 1024, 4, False),
        (8, 512, 4, False),
        (2, 2048, 4, False),
        (4, 512, 2, False),
        (4, 1024, 4, True),
        (8, 512, 4, True),
    ]
]
DOT = [
    QuantMatmulConfig("dot", n, k, w, m, s)
    for m, n, k, w, s in [
        (16, 32, 128, 4, 3),
        (16, 64, 128, 4, 3),
        (16, 64, 256, 4, 3),
        (16, 128, 128, 8, 3),
        (32, 64, 128, 4, 3),
        (64, 64, 64, 4, 3),
        (64, 128, 64, 8, 3),
        (128, 128, 64, 8, 3),
        (64, 64, 128, 4, 4),
    ]
]


ONE_ROW_SWEEP = DP4A + INT8X + HALF2 + ACC


def parse_configs(spec: str) -> list[QuantMatmulConfig]:
    """kind:rows:block_k:warps[:stages], comma separated."""
    return [one_row_config(*item.split(":", 1)) for item in spec.split(",")]


def nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def quantize_time(x: torch.Tensor) -> float:
    """µs of `quantize_x_int8` alone on x, the launch the fused rounding saves."""
    return time_fn([lambda: quantize_x_int8(x)], label="int8 rounding") * 1e6


def bench_shape(
    name: str, n: int, k: int, ms: list[int], qtype: str, sweep: bool, kinds: set[str] | None = None
) -> dict[str, Any]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q = repack(quantize_blocks(w, qtype), qtype)
    copies = max(2, int(2 * L2_BYTES // nbytes(q.qs, q.d, q.m)) + 1)
    qs = [repack(quantize_blocks(w.roll(i, 0), qtype), qtype) for i in range(copies)]
    ws = [w.roll(i, 0).contiguous() for i in range(max(2, int(2 * L2_BYTES // nbytes(w)) + 1))]
    out: dict[str, Any] = {"n": n, "k": k, "qtype": qtype, "weight_bytes": nbytes(q.qs, q.d, q.m), "by_m": {}}
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = time_fn([lambda ww=ww, x=x: F.linear(x, ww) for ww in ws], label=f"{name} bf16")
        row: dict[str, Any] = {"cublas_us": bf16 * 1e6}
        if m >= 512:  # the prefill alternative: dequantize to bf16, then cuBLAS
            row["dequant_cublas_us"] = (
                time_fn([lambda qq=qq, x=x: F.linear(x, dequantize(qq).to(x.dtype)) for qq in qs[:2]], reps=8)
                * 1e6
            )
        if m <= 8:
            row["gemv_us"] = (
                time_fn([lambda ww=ww, x=x: gemv(x, ww) for ww in ws], label=f"{name} gemv") * 1e6
            )
        # the config quant_matmul runs, then the row count's CUDA-core default beside it
        cfgs = list(dict.fromkeys([choose_config(x, q), default_config(m)]))
        if sweep:
            more = (ONE_ROW_SWEEP if m == 1 else []) + (FMA if m <= 8 else []) + DOT
            cfgs += [
                c
                for c in more
                if c not in cfgs
                and (kinds is None or c.kind in kinds)
                and (c.kind != "half2" or qtype in HALF2_FORMATS)
            ]
        times = {}
        for c in cfgs:
            try:
                times[c.label()] = (
                    time_fn([lambda qq=qq, c=c, x=x: quant_matmul(x, qq, c) for qq in qs], label=c.label())
                    * 1e6
                )
            except Exception as e:  # a config that does not compile here (shared memory) is skipped
                times[c.label()] = None
                print(f"  {c.label()}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        # int8x and stream with x rounded beforehand (as the model's norm or SiLU-and-mul rounds it
        # in its own launch): the matmul alone, apart from the configs' two-launch times
        pre = {}
        for c in cfgs:
            if c.kind in INT8_ROW_KINDS and times.get(c.label()) is not None:
                xq = quantize_x_int8(x)
                fns = [lambda qq=qq, c=c, x=x, xq=xq: quant_matmul(x, qq, c, x_int8=xq) for qq in qs]
                pre[c.label()] = time_fn(fns, label=c.label() + " pre-rounded") * 1e6
        if pre:
            row["int8x_pre_rounded_us"] = pre
            row["int8x_rounding_launch_us"] = quantize_time(x)
        ok = {k2: v for k2, v in times.items() if v is not None}
        best = min(ok, key=ok.__getitem__)
        row.update(
            default=cfgs[0].label(),
            default_us=times[cfgs[0].label()],
            best=best,
            best_us=ok[best],
            best_tb_s=out["weight_bytes"] / ok[best] / 1e6,
            vs_bf16_best=min(bf16 * 1e6, row.get("gemv_us", float("inf"))) / ok[best],
            configs=times,
        )
        out["by_m"][m] = row
        print(
            f"{name} {qtype} M={m}: bf16 {row['cublas_us']:.1f} us, gemv {row.get('gemv_us', 0):.1f}, "
            f"default {row['default_us']} ({row['default']}), best {ok[best]:.1f} ({best}) "
            f"{row['best_tb_s']:.2f} TB/s",
            flush=True,
        )
    return out


def pre_rounded(shapes: dict[str, Any], kind: str) -> dict[str, dict[str, float]]:
    """Per layer shape (Q4_0, one row): kind's configs' µs with x already rounded."""
    return {
        name: {
            label: us
            for label, us in shapes[f"{name} Q4_0"]["by_m"].get(1, {}).get("int8x_pre_rounded_us", {}).items()
            if label.startswith(kind + " ")
        }
        for name in SHAPES
    }


def least(pre: dict[str, dict[str, float]], names: list[str]) -> tuple[str, float] | None:
    """The config with the least µs summed over the named shapes (timed on all of them)."""
    totals = {
        label: sum(pre[n][label] for n in names)
        for label in pre[names[0]]
        if all(label in pre[n] for n in names)
    }
    return min(totals.items(), key=lambda kv: kv[1]) if totals else None


def spec(label: str) -> str:
    """A config label in --configs' form: "int8x m16 n8 k4096 w4 s1" → "8:4096:4:1" (a stream's
    programs per multiprocessor, "p32", appended)."""
    fields = dict((f[0], f[1:]) for f in label.split()[1:] if f[0] in "nkwsp")
    return ":".join(fields[key] for key in "nkwsp" if key in fields)


def fastest_int8x(shapes: dict[str, Any]) -> dict[str, Any] | None:
    """The int8x configs with the least time given x already rounded: summed over the Q4_0 layer
    shapes of K < LONG_K, and on the down projection (K >= LONG_K); with them in SUITE_INT8X's
    form (benchmarks/suite_quant.py), or None where no int8x config was timed so."""
    pre = pre_rounded(shapes, "int8x")
    short = least(pre, [name for name, (_, k) in SHAPES.items() if k < LONG_K])
    long = least(pre, ["down"])
    if short is None or long is None:
        return None
    return {
        "short": short[0],
        "short_us": short[1],
        "long": long[0],
        "long_us": long[1],
        "suite_int8x": f"{spec(short[0])}/{spec(long[0])}",
    }


def fastest_stream(shapes: dict[str, Any]) -> dict[str, Any] | None:
    """The stream config with the least time on gate_up, on down and on the rest (qkv and o,
    whose o needs its own rounding launch), x rounded beforehand, beside the default choice's time
    there (int8x's with x rounded beforehand, dp4a's as it runs); SUITE_STREAM's "short/long/rest"
    names a config only where it beats the default ("-" elsewhere)."""
    pre = pre_rounded(shapes, "stream")
    roles = {"short": ["gate_up"], "long": ["down"], "rest": ["qkv", "o"]}
    out: dict[str, Any] = {}
    specs = []
    for role, names in roles.items():
        best = least(pre, names)
        if best is None:
            return None
        rows = [shapes[f"{n} Q4_0"]["by_m"][1] for n in names]
        default = sum(r.get("int8x_pre_rounded_us", {}).get(r["default"], r["default_us"]) for r in rows)
        us = best[1] + (rows[-1].get("int8x_rounding_launch_us", 0.0) if role == "rest" else 0.0)
        out[role] = {"config": best[0], "us": us, "default_us": default}
        specs.append(spec(best[0]) if us < default else "-")
    out["suite_stream"] = "/".join(specs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--ms", default="1,2,8,16,128,2048")
    p.add_argument("--kinds", default=None, help="sweep only these kernel kinds (comma list)")
    p.add_argument("--dp4a-rows", default=None, help="rows per program the dp4a sweep tries (comma list)")
    p.add_argument(
        "--configs",
        default=None,
        help="one-row configs to time instead of the sweep's (kind:rows:block_k:warps[:stages[:programs_per_sm]],...)",
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    ms = [int(x) for x in args.ms.split(",")]
    kinds = set(args.kinds.split(",")) if args.kinds else None
    if args.dp4a_rows:
        DP4A[:] = dp4a_configs(tuple(int(r) for r in args.dp4a_rows.split(",")))
    if args.configs:
        ONE_ROW_SWEEP[:] = parse_configs(args.configs)
    res: dict[str, Any] = {
        "benchmark": "quant_gpu",
        "env": environment(),
        "defaults": {str(k): v.label() for k, v in DEFAULTS.items()},
    }
    res["shapes"] = {
        f"{name} Q4_0": bench_shape(name, n, k, ms, "Q4_0", not args.no_sweep, kinds)
        for name, (n, k) in SHAPES.items()
    }
    few = [m for m in (1, 16) if m in ms] or ms[:1]
    res["shapes"]["gate_up Q4_1"] = bench_shape("gate_up", 28672, 4096, few, "Q4_1", bool(kinds), kinds)
    res["shapes"]["gate_up Q8_0"] = bench_shape("gate_up", 28672, 4096, few, "Q8_0", bool(kinds), kinds)
    res["shapes"]["lm_head Q8_0"] = bench_shape(
        "lm_head", 128256, 4096, [m for m in (1, 128) if m in ms] or ms[:1], "Q8_0", bool(args.configs), kinds
    )
    # per M: the config with the least summed time over the layer shapes (the defaults to use)
    suggested = {}
    for m in ms:
        totals: dict[str, float] = {}
        for name in SHAPES:
            for label, us in res["shapes"][f"{name} Q4_0"]["by_m"][m]["configs"].items():
                totals[label] = totals.get(label, 0.0) + (us if us is not None else float("inf"))
        suggested[m] = min(totals, key=totals.__getitem__)
    res["suggested_by_m"] = suggested
    fastest = fastest_int8x(res["shapes"])
    if fastest:
        res["int8x_fastest"] = fastest
        print(f"SUITE_INT8X={fastest['suite_int8x']}  (int8x, x rounded beforehand: {fastest})")
    streaming = fastest_stream(res["shapes"])
    if streaming:
        res["stream_fastest"] = streaming
        print(f"SUITE_STREAM={streaming['suite_stream']}  (stream, x rounded beforehand: {streaming})")
    res["elapsed_s"] = time.perf_counter() - t0
    print(json.dumps(suggested, indent=1))
    if args.out:
        write_result(Path(args.out), res)


if __name__ == "__main__":
    main()
