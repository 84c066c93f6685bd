"""Decode GEMV benchmark for the H200: cuBLAS (F.linear) vs `radixlm.kernels.gemv` over a small
config sweep, M in 1/2/4/8, the llama-3.1-8b linear shapes (bf16). Cold L2 (weight copies rotated,
> 180 MB per shape), launch cost hidden (CUDA graph of back-to-back calls, kernels_common.time_fn);
every timed config is first checked against gemv_ref. Prints a table, writes JSON (--out).
Usage: python benchmarks/gemv.py [--out PATH] [--ms 1,2,4,8]; CPU: --help, --dry-run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be on before triton defines the kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # kernel_checks, grammar_helpers
from bench_env import environment, write_result  # noqa: E402
from kernel_checks import BOUND, rel_err  # noqa: E402

from radixlm.kernels.gemv import GemvConfig, default_config, gemv, gemv_ref  # noqa: E402

# (name, N, K, calls per decode step of llama-3.1-8b)
SHAPES = [
    ("qkv", 6144, 4096, 32),
    ("o_proj", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 1),
]
SWEEP = [
    GemvConfig("fma", 8, 512, 4),
    GemvConfig("fma", 4, 1024, 4),
    GemvConfig("fma", 2, 2048, 4),
    GemvConfig("fma", 2, 4096, 4),
    GemvConfig("fma", 4, 2048, 8),
    GemvConfig("fma", 8, 1024, 8),
    GemvConfig("fma", 8, 512, 4, 3),
    GemvConfig("fma", 4, 1024, 4, 3),
    GemvConfig("dot", 16, 256, 4, 4),
    GemvConfig("dot", 16, 512, 4, 3),
    GemvConfig("dot", 32, 256, 4, 4),
    GemvConfig("dot", 16, 128, 4, 6),
    GemvConfig("dot", 32, 128, 4, 6),
]
CALLS = {s: c for s, _, _, c in SHAPES}
BUDGET_S = 110.0  # sweep stops (remaining rows marked skipped) so the whole run stays < 2.5 min
L2_BYTES = 60e6


def n_copies(nbytes: int) -> int:
    return max(2, -(-int(3 * L2_BYTES) // nbytes))


def make_sets(n: int, k: int, m: int, dt: torch.dtype, dev: str, copies: int) -> list[tuple]:
    return [
        (
            torch.randn(m, k, device=dev).to(dt),
            (torch.randn(n, k, device=dev) / k**0.5).to(dt),
            torch.empty(m, n, dtype=dt, device=dev),
        )
        for _ in range(copies)
    ]


def gpu_timer(fns: list) -> float:
    from kernels_common import time_fn

    return time_fn(fns, reps=40, trials=5)


def bench_shape(
    name: str,
    n: int,
    k: int,
    m: int,
    weights: list[torch.Tensor],
    dt: torch.dtype,
    dev: str,
    timer,
    deadline: float,
) -> list[dict]:
    xs = [torch.randn(m, k, device=dev).to(dt) for _ in weights]
    outs = [torch.empty(m, n, dtype=dt, device=dev) for _ in weights]
    wbytes = n * k * weights[0].element_size()
    ref = gemv_ref(xs[0], weights[0])
    rows = []

    def row(impl: str, cfg: str, secs: float | None, err: float | None, note: str = "") -> dict:
        r = {
            "shape": name,
            "M": m,
            "N": n,
            "K": k,
            "impl": impl,
            "config": cfg,
            "rel_err": err,
            "note": note,
            "us": None if secs is None else secs * 1e6,
            "tbps": None if secs is None else wbytes / secs / 1e12,
        }
        rows.append(r)
        return r

    row(
        "cublas",
        "F.linear",
        timer([lambda i=i: F.linear(xs[i], weights[i]) for i in range(len(xs))]),
        rel_err(F.linear(xs[0], weights[0]), ref),
    )
    sweep = SWEEP + [c for c in [default_config(m)] if c not in SWEEP]
    for cfg in sweep:
        if time.perf_counter() > deadline:
            row("gemv", cfg.label(), None, None, "skipped: time budget")
            continue
        try:
            outs[0].fill_(float("nan"))
            err = rel_err(gemv(xs[0], weights[0], config=cfg, out=outs[0]), ref)
            if not err <= BOUND[dt]:
                row("gemv", cfg.label(), None, err, "WRONG: not timed")
                continue
            fns = [lambda i=i, c=cfg: gemv(xs[i], weights[i], config=c, out=outs[i]) for i in range(len(xs))]
            row("gemv", cfg.label(), timer(fns), err)
        except Exception as exc:  # one bad config (e.g. out of shared memory) must not end the sweep
            row("gemv", cfg.label(), None, None, f"error: {type(exc).__name__}: {str(exc)[:160]}")
    return rows


def best_rows(rows: list[dict]) -> dict[str, dict]:
    """Per (M, shape): cuBLAS, the best gemv config and DEFAULT's row."""
    out: dict[str, dict] = {}
    for r in rows:
        key = f"M={r['M']} {r['shape']}"
        e = out.setdefault(key, {"M": r["M"], "shape": r["shape"], "calls": 0})
        e["calls"] = CALLS.get(r["shape"], 1)
        if r["us"] is None:
            continue
        if r["impl"] == "cublas":
            e["cublas"] = r
        elif "best" not in e or r["us"] < e["best"]["us"]:
            e["best"] = r
        if r["impl"] == "gemv" and r["config"] == default_config(r["M"]).label():
            e["default"] = r
    return out


def print_table(best: dict[str, dict]) -> dict[int, dict]:
    """The table, plus per M the summed per-decode-step µs (calls x µs) for cuBLAS / best / DEFAULT."""
    print(
        f"{'case':<16}{'cuBLAS us':>10}{'TB/s':>6}{'best us':>9}{'TB/s':>6}{'x':>6}  {'best config':<24}"
        f"{'default us':>10}"
    )
    step: dict[int, dict] = {}
    for key, e in best.items():
        c, b, d = e.get("cublas"), e.get("best"), e.get("default")
        f = lambda r, f: f"{r[f]:.2f}" if r else "-"  # noqa: E731
        speed = f"{c['us'] / b['us']:.2f}" if c and b else "-"
        print(
            f"{key:<16}{f(c, 'us'):>10}{f(c, 'tbps'):>6}{f(b, 'us'):>9}{f(b, 'tbps'):>6}{speed:>6}  "
            f"{b['config'] if b else '-':<24}{f(d, 'us'):>10}"
        )
        s = step.setdefault(e["M"], {"cublas_us": 0.0, "best_us": 0.0, "default_us": 0.0, "complete": True})
        for name, r in (("cublas_us", c), ("best_us", b), ("default_us", d)):
            if r is None:
                s["complete"] = False
            else:
                s[name] += e["calls"] * r["us"]
    for m, s in step.items():
        print(
            f"M={m}: linear layers per decode step: cuBLAS {s['cublas_us']:.0f} us, best gemv "
            f"{s['best_us']:.0f} us, DEFAULT {s['default_us']:.0f} us"
            + ("" if s["complete"] else " (incomplete)")
        )
    return step


def suggest(rows: list[dict]) -> dict[int, str]:
    """Per M: the one config with the least per-decode-step time (calls x µs summed over the
    shapes), among configs timed at every shape; printed as a DEFAULTS line for kernels/gemv.py."""
    out: dict[int, str] = {}
    for m in sorted({r["M"] for r in rows}):
        mine = [r for r in rows if r["M"] == m and r["impl"] == "gemv"]
        n_shapes = len({r["shape"] for r in mine})
        totals = {}
        for label in {r["config"] for r in mine}:
            timed = [r for r in mine if r["config"] == label and r["us"] is not None]
            if len(timed) == n_shapes:
                totals[label] = sum(CALLS.get(r["shape"], 1) * r["us"] for r in timed)
        if totals:
            out[m] = min(totals, key=totals.get)
            print(f"SUGGESTED DEFAULT M<={m}: {out[m]} ({totals[out[m]]:.0f} us per step)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/gemv_h200.json")
    ap.add_argument("--ms", default="1,2,4,8", help="comma-separated row counts M")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: tiny shapes under the Triton interpreter, "
        "fake times, JSON to /tmp (rehearses the sweep, checks and table)",
    )
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --dry-run)")
    dev, dt = ("cpu", torch.bfloat16) if dry else ("cuda", torch.bfloat16)
    shapes = [(s, 40 + 8 * i, 96 + 64 * i, c) for i, (s, _, _, c) in enumerate(SHAPES)] if dry else SHAPES
    timer = (lambda fns: 1e-6 * (1 + len(fns))) if dry else gpu_timer
    t0 = time.perf_counter()
    deadline = t0 + BUDGET_S
    rows: list[dict] = []
    weights = {
        s: [(torch.randn(n, k, device=dev) / k**0.5).to(dt) for _ in range(n_copies(n * k * 2))]
        for s, n, k, _ in shapes
    }
    for m in ms:  # M=1 first: the batch-1 decode case gets timed even if the budget runs out
        for s, n, k, _ in shapes:
            rows += bench_shape(s, n, k, m, weights[s], dt, dev, timer, deadline)
            print(f"  done M={m} {s} ({time.perf_counter() - t0:.0f} s)", flush=True)
    best = best_rows(rows)
    step = print_table(best)
    wrong = [r for r in rows if r["note"].startswith(("WRONG", "error"))]
    for r in wrong:
        print("!!", r["shape"], r["M"], r["config"], r["note"], r["rel_err"])
    from kernels_common import GRAPH_FAILURES

    result = {
        "env": environment(),
        "dtype": str(dt),
        "defaults": {m: default_config(m).label() for m in ms},
        "suggested_defaults": suggest(rows),
        "elapsed_s": time.perf_counter() - t0,
        "step_us_by_M": step,
        "best": best,
        "rows": rows,
        "graph_failures": GRAPH_FAILURES,
        "n_wrong_or_error": len(wrong),
        "dry_run": dry,
    }
    write_result("/tmp/gemv_dry_run.json" if dry else args.out, result)


if __name__ == "__main__":
    main()
