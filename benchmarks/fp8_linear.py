"""FP8 weight linears vs bf16 at the Llama-3.1-8B decoder shapes (qkv, o_proj, gate_up, down), M rows
in 1/8/64/128/256: bf16 cuBLAS (F.linear) and, for few rows, radixlm's bf16 GEMV, against
Fp8Linear's default path, each scaled_mm call forced (per-row activation quantization + _scaled_mm
with row-wise scales, fast and exact accumulation; or unit scales + the epilogue), the quantization kernel alone, and the weight-only fp8 GEMV over a
small config sweep. Cold L2 (weight copies rotated, > 180 MB per impl), launch cost hidden (CUDA
graph of back-to-back calls, kernels_common.time_fn); every impl is checked against an fp32
reference over its own operands before it is timed. Prints a table and the summed linear time per
decode step (32 layers) per M, writes JSON (--out).
Usage: python benchmarks/fp8_linear.py [--out PATH] [--ms 1,8,64,128,256]; CPU: --dry-run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be on before triton defines the kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_env import device_tag, environment, write_result  # noqa: E402

from radixlm.backend.fp8_linear import (  # noqa: E402
    GEMV_MAX_M,
    Fp8Linear,
    fp8_linear_ref,
    scaled_mm_rowwise,
    scaled_mm_unit,
)
from radixlm.kernels.fp8_gemv import MAX_M as GEMV_ROWS  # noqa: E402
from radixlm.kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref  # noqa: E402
from radixlm.kernels.fp8_quant import quantize_rows, quantize_rows_ref  # noqa: E402
from radixlm.kernels.gemv import MAX_M as BF16_GEMV_ROWS  # noqa: E402
from radixlm.kernels.gemv import GemvConfig, gemv  # noqa: E402

# (name, N, K, calls per decode step of llama-3.1-8b); the LM head stays bf16, so it is not here
SHAPES = [
    ("qkv", 6144, 4096, 32),
    ("o_proj", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
]
GEMV_SWEEP = [
    GemvConfig("fma", 2, 4096, 4, 3),
    GemvConfig("fma", 4, 2048, 4, 3),
    GemvConfig("fma", 8, 1024, 4, 3),
    GemvConfig("fma", 4, 4096, 8, 3),
    GemvConfig("fma", 8, 2048, 8, 3),
    GemvConfig("fma", 16, 1024, 8, 3),
]
L2_BYTES = 60e6
BF16 = torch.bfloat16
BOUND = 2e-2  # vs the fp32 reference over the same operands (bf16 output rounding, fast accumulation)


def n_copies(nbytes: int) -> int:
    """Buffers to rotate so one round reads 3x the L2 (two on the CPU dry run)."""
    return 2 if os.environ.get("TRITON_INTERPRET") == "1" else max(2, -(-int(3 * L2_BYTES) // nbytes))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def gpu_timer(fns: list[Callable[[], object]]) -> float:
    from kernels_common import time_fn

    return time_fn(fns, reps=40, trials=5)


def bench_shape(
    name: str, n: int, k: int, m: int, dev: str, timer: Callable[[list[Callable[[], object]]], float]
) -> list[dict]:
    ws = [(torch.randn(n, k, device=dev) / k**0.5).to(BF16) for _ in range(n_copies(n * k * 2))]
    layers = []
    for i in range(n_copies(n * k)):  # fp8 copies: half the bytes, so more of them for a cold L2
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=BF16)
        with torch.no_grad():
            lin.weight.copy_(ws[i] if i < len(ws) else (torch.randn(n, k, device=dev) / k**0.5).to(BF16))
        layers.append(Fp8Linear.from_linear(lin))
        del lin
    copies = max(len(ws), len(layers))
    xs = [torch.randn(m, k, device=dev).to(BF16) for _ in range(copies)]
    w_of = lambda i: ws[i % len(ws)]  # noqa: E731
    f_of = lambda i: layers[i % len(layers)]  # noqa: E731
    vs_bf16 = F.linear(xs[0].float(), ws[0].float())  # layers[0] is ws[0] quantized
    deq = layers[0].weight.float() * layers[0].weight_scale[:, None]
    rows: list[dict] = []

    def add(
        impl: str,
        config: str,
        fn: Callable[[int], object],
        ref: torch.Tensor,
        result: Callable[[object], torch.Tensor] = lambda y: y,  # type: ignore[assignment,return-value]
    ) -> None:
        row = {"shape": name, "M": m, "N": n, "K": k, "impl": impl, "config": config, "note": ""}
        rows.append(row)
        try:
            out = result(fn(0))
            row["rel_err"] = rel_err(out, ref)
            row["rel_err_vs_bf16_weight"] = rel_err(out, vs_bf16) if out.shape == vs_bf16.shape else None
            if not row["rel_err"] <= BOUND:
                row["note"] = "WRONG: not timed"
                row["us"] = None
                return
            row["us"] = timer([lambda i=i: fn(i) for i in range(copies)]) * 1e6
        except Exception as exc:  # one failing impl (unsupported op, no memory) must not end the run
            row["us"], row["note"] = None, f"error: {type(exc).__name__}: {str(exc)[:160]}"

    add("bf16", "cublas F.linear", lambda i: F.linear(xs[i], w_of(i)), vs_bf16)
    if m <= BF16_GEMV_ROWS:
        add("bf16", "radixlm gemv", lambda i: gemv(xs[i], w_of(i)), vs_bf16)
    path = layers[0].path(xs[0])
    same_ref = (
        fp8_linear_ref(layers[0], xs[0]) if path.startswith("scaled_mm") else F.linear(xs[0].float(), deq)
    )
    add("fp8", f"Fp8Linear default ({path})", lambda i: f_of(i)(xs[i]), same_ref)

    def scaled(i: int, fast: bool) -> torch.Tensor:
        layer = f_of(i)
        xq, xs_ = quantize_rows(xs[i])
        return scaled_mm_rowwise(xq, xs_, layer.weight, layer.weight_scale, None, BF16, fast)

    def unit(i: int) -> torch.Tensor:
        layer = f_of(i)
        xq, xs_ = quantize_rows(xs[i])
        return scaled_mm_unit(xq, xs_, layer.weight, layer.weight_scale, None, BF16)

    mm_ref = fp8_linear_ref(layers[0], xs[0])
    add("fp8", "scaled_mm unit scales + epilogue", unit, mm_ref)
    add("fp8", "scaled_mm fast-accum", lambda i: scaled(i, True), mm_ref)
    add("fp8", "scaled_mm exact-accum", lambda i: scaled(i, False), mm_ref)
    add(
        "fp8",
        "quantize_rows only",
        lambda i: quantize_rows(xs[i]),
        quantize_rows_ref(xs[0])[0].float(),
        lambda qs: qs[0].float(),  # type: ignore[index]
    )
    if m <= GEMV_ROWS:
        for cfg in GEMV_SWEEP:
            add(
                "fp8",
                f"gemv {cfg.label()}",
                lambda i, c=cfg: fp8_gemv(xs[i], f_of(i).weight, f_of(i).weight_scale, config=c),
                fp8_gemv_ref(xs[0].float(), layers[0].weight, layers[0].weight_scale),
            )
    return rows


def summarize(rows: list[dict]) -> dict[int, dict]:
    """Per M: linear time per decode step (calls x µs summed over the shapes) for the bf16 path the
    model takes (GEMV at one row, cuBLAS above), Fp8Linear's default, and the best fp8 impl."""
    calls = {s: c for s, _, _, c in SHAPES}
    out: dict[int, dict] = {}
    for m in sorted({r["M"] for r in rows}):
        s = {"bf16_model_us": 0.0, "fp8_default_us": 0.0, "fp8_best_us": 0.0, "complete": True}
        for shape in calls:
            mine = [r for r in rows if r["M"] == m and r["shape"] == shape and r["us"] is not None]
            bf16 = [r for r in mine if r["impl"] == "bf16" and (r["config"] == "radixlm gemv") == (m == 1)]
            dflt = [r for r in mine if r["config"].startswith("Fp8Linear default")]
            best = [r for r in mine if r["impl"] == "fp8" and not r["config"].startswith("quantize")]
            if not (bf16 and dflt and best):
                s["complete"] = False
                continue
            s["bf16_model_us"] += calls[shape] * bf16[0]["us"]
            s["fp8_default_us"] += calls[shape] * dflt[0]["us"]
            b = min(best, key=lambda r: r["us"])
            s["fp8_best_us"] += calls[shape] * b["us"]
            s[f"best_{shape}"] = b["config"]
        s["speedup_default"] = s["bf16_model_us"] / s["fp8_default_us"] if s["fp8_default_us"] else None
        out[m] = s
    return out


def print_table(rows: list[dict], step: dict[int, dict]) -> None:
    print(f"{'M':>4} {'shape':<8} {'impl':<5} {'config':<34} {'us':>9} {'err':>9} {'vs bf16 W':>9}  note")
    for r in rows:
        us = f"{r['us']:.2f}" if r.get("us") is not None else "-"
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        vb = f"{r['rel_err_vs_bf16_weight']:.1e}" if r.get("rel_err_vs_bf16_weight") is not None else "-"
        print(
            f"{r['M']:>4} {r['shape']:<8} {r['impl']:<5} {r['config']:<34} {us:>9} {err:>9} {vb:>9}  {r['note']}"
        )
    for m, s in step.items():
        sp = f"{s['speedup_default']:.2f}x" if s["speedup_default"] else "-"
        print(
            f"M={m}: linears per decode step: bf16 (model path) {s['bf16_model_us']:.0f} us, fp8 default "
            f"{s['fp8_default_us']:.0f} us ({sp}), best fp8 {s['fp8_best_us']:.0f} us"
            + ("" if s["complete"] else " (incomplete)")
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/fp8_linear_<gpu>.json)"
    )
    ap.add_argument("--ms", default="1,8,64,128,256", help="comma-separated row counts M")
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU: tiny shapes, interpreter, fake times, JSON to /tmp"
    )
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --dry-run)")
    dev = "cpu" if dry else "cuda"
    shapes = [(s, 48 + 16 * i, 64 + 32 * i, c) for i, (s, _, _, c) in enumerate(SHAPES)] if dry else SHAPES
    timer = (lambda fns: 1e-6 * (1 + len(fns))) if dry else gpu_timer
    torch.manual_seed(0)
    t0 = time.perf_counter()
    rows: list[dict] = []
    for m in ms:
        for s, n, k, _ in shapes:
            rows += bench_shape(s, n, k, m, dev, timer)
            if dev == "cuda":
                torch.cuda.empty_cache()
            print(f"  done M={m} {s} ({time.perf_counter() - t0:.0f} s)", flush=True)
    step = summarize(rows)
    print_table(rows, step)
    from kernels_common import GRAPH_FAILURES

    env = environment()
    result = {
        "env": env,
        "fp8_gemv_max_m": GEMV_MAX_M,
        "elapsed_s": time.perf_counter() - t0,
        "step_us_by_M": step,
        "rows": rows,
        "graph_failures": GRAPH_FAILURES,
        "n_wrong_or_error": sum(1 for r in rows if r["note"]),
        "dry_run": dry,
    }
    out = (
        "/tmp/fp8_linear_dry_run.json"
        if dry
        else args.out or f"benchmarks/results/fp8_linear_{device_tag(env)}.json"
    )
    write_result(out, result)


if __name__ == "__main__":
    main()
