"""Kernel benchmark for the H200 (issue 7): our Triton kernels vs FlashInfer 0.7.4 (a yardstick,
never a dependency) vs the memory / tensor-core roofline measured in the same run, Hq 32 / Hkv 8 /
D 128 bf16. Checks every kernel against its torch reference at every shape first. Cold L2
(rotating buffer sets > 180 MB), launch cost hidden (back-to-back calls between CUDA events).
Also fp8-KV decode beside FlashInfer bf16 (kernels_fp8.py; the target is 1.8x FlashInfer's bf16 time at B=64 L=4096).
Writes OUT/kernels_h200.json and OUT/kernels_h200.png (OUT/kernels_h200_<only>.* with --only).
Usage: python benchmarks/kernels.py OUT [--sweep] [--only cascade|fp8]; CPU: --dry-run, --reanalyze, --help."""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # kernel_checks, grammar_helpers
import kernel_checks as checks  # noqa: E402
import kv_fp8_checks  # noqa: E402
from kernels_cascade import bench_cascade, dry_run  # noqa: E402
from kernels_common import (  # noqa: E402
    DEV,
    DT,
    GRAPH_FAILURES,
    HKV,
    HQ,
    PAGE,
    D,
    fi_decode,
    fi_pages,
    fi_view,
    graph_splits,
    kv_sets,
    log,
    n_sets,
    paged_table,
    time_fn,
)
from kernels_fp8 import bench_fp8_decode, fp8_ratios  # noqa: E402

from radixlm.kernels.decode_attention import decode_attention  # noqa: E402
from radixlm.kernels.decode_splits import choose_num_splits  # noqa: E402
from radixlm.kernels.extend_attention import extend_attention, extend_config  # noqa: E402

# (batch, length); B=1 L=768 is where the suite's batch-1 decode ends (512 prompt + 256 new)
DECODE = [(1, 768), (1, 4096), (64, 4096), (128, 2048), (256, 1024), (32, 16384)]
EXTEND = [
    ("B=8 2048+512", [2048] * 8, [512] * 8),
    ("B=32 1024+128", [1024] * 32, [128] * 32),
    ("one 8192 prompt", [0], [8192]),
]


def ceilings() -> dict:
    x = torch.empty(int(2e9), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    t = time_fn([lambda: y.copy_(x)], reps=10, trials=5, graph=False)  # a graph turns it into a DMA memcpy
    a = torch.randn(8192, 8192, dtype=DT, device=DEV)
    bm = torch.randn(8192, 8192, dtype=DT, device=DEV)
    tm = time_fn([lambda: a @ bm], reps=10, trials=5)
    return {"copy_TBps": 4e9 / t / 1e12, "bf16_matmul_TFLOPs": 2 * 8192**3 / tm / 1e12}


def bench_decode(fi, bw: float, sweep: bool) -> list[dict]:
    rows = [decode_shape(fi, bw, sweep, bsz, L) for bsz, L in DECODE]
    return rows


def decode_shape(fi, bw: float, sweep: bool, bsz: int, L: int) -> dict:
    seq = [L] * bsz
    kv_bytes = 2 * bsz * L * HKV * D * 2
    table, n_slots = paged_table(seq)
    sets = kv_sets(n_slots, n_sets(kv_bytes))
    qs = [torch.randn(bsz, HQ, D, dtype=DT, device=DEV) for _ in sets]
    lens = torch.tensor(seq, device=DEV)
    ridx = torch.arange(bsz, device=DEV)
    splits = choose_num_splits(bsz, HKV, L, torch.cuda.get_device_properties(0).multi_processor_count)

    def ours(i, s=splits, table=table, **kw):
        return lambda: decode_attention(qs[i], sets[i][0], sets[i][1], table, ridx, lens, num_splits=s, **kw)

    row = {
        "shape": f"B={bsz} L={L}",
        "batch": bsz,
        "len": L,
        "kv_bytes": kv_bytes,
        "splits": splits,
        "roofline_us": (kv_bytes + 2 * bsz * HQ * D * 2) / bw * 1e6,
    }
    row["ours_us"] = time_fn([ours(i) for i in range(len(sets))], label="decode") * 1e6
    row["ours_eager_us"] = time_fn([ours(i) for i in range(len(sets))], graph=False) * 1e6
    scat, _ = paged_table(seq, scattered=True)
    row["ours_scattered_slots_us"] = time_fn([ours(i, table=scat) for i in range(len(sets))]) * 1e6
    if sweep:
        row["sweep"] = sweep_decode(ours, len(sets), splits, graph_splits(bsz))
    if fi is not None:
        row["flashinfer_us"] = fi_decode(fi, table, seq, sets, qs)
        row["flashinfer_eager_us"] = fi_decode(fi, table, seq, sets, qs, graph=False)
    row["ours_TBps"] = kv_bytes / row["ours_us"] / 1e6
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    return row


def sweep_decode(ours, n: int, splits: int, in_graph: int) -> list[dict]:
    out = []
    for bn, nw, ns in [
        (32, 4, 2),
        (64, 4, 2),
        (64, 4, 3),
        (64, 8, 2),
        (128, 4, 2),
        (128, 8, 2),
        (64, 2, 2),
        (32, 2, 3),
        (128, 8, 3),
    ]:
        # one split too: no merge launch, which short rows of a small batch may not repay
        for s in sorted({1, max(1, splits // 2), splits, splits * 2, splits * 4, in_graph}):
            try:
                t = time_fn([ours(i, s, block_n=bn, num_warps=nw, num_stages=ns) for i in range(n)], 20, 3)
                out.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "splits": s, "us": t * 1e6})
            except Exception as exc:  # a config that does not compile is recorded, not fatal
                out.append(
                    {"block_n": bn, "num_warps": nw, "num_stages": ns, "splits": s, "error": str(exc)[:200]}
                )
    best = min((r for r in out if "us" in r), key=lambda r: r["us"], default=None)
    log("  decode sweep best:", best)
    return out


def extend_flops(prefix: list[int], ext: list[int]) -> float:
    return 4.0 * D * HQ * sum(e * p + e * (e + 1) / 2 for p, e in zip(prefix, ext))


def bench_extend(fi, tflops: float, bw: float, sweep: bool) -> list[dict]:
    return [extend_shape(fi, tflops, bw, sweep, name, prefix, ext) for name, prefix, ext in EXTEND]


def extend_shape(
    fi, tflops: float, bw: float, sweep: bool, name: str, prefix: list[int], ext: list[int]
) -> dict:
    seq = [p + e for p, e in zip(prefix, ext)]
    table, n_slots = paged_table(seq)  # new tokens' slots too (FlashInfer reads them from the pages)
    sets = kv_sets(n_slots, 2)
    t = sum(ext)
    qkv = [tuple(torch.randn(t, h, D, dtype=DT, device=DEV) for h in (HQ, HKV, HKV)) for _ in sets]
    pl, el = torch.tensor(prefix, device=DEV), torch.tensor(ext, device=DEV)
    starts = torch.cumsum(el, 0) - el
    ridx = torch.arange(len(seq), device=DEV)

    def ours(i, **kw):
        q, k, v = qkv[i]
        return lambda: extend_attention(
            q, k, v, sets[i][0], sets[i][1], table, ridx, pl, el, starts, max(ext), **kw
        )

    flops = extend_flops(prefix, ext)
    row = {
        "shape": name,
        "flops": flops,
        "roofline_us": max(flops / tflops / 1e12, 2 * sum(seq) * HKV * D * 2 / bw) * 1e6,
        "ours_us": time_fn([ours(i) for i in range(2)], 10, 5, label="extend") * 1e6,
    }
    if sweep:
        row["sweep"] = sweep_extend(ours)
    if fi is not None:
        row["flashinfer_us"] = fi_extend(fi, table, seq, ext, sets, qkv)
    row["ours_TFLOPs"] = flops / row["ours_us"] / 1e6
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    return row


def sweep_extend(ours) -> list[dict]:
    out = []
    for pack in (True, False):
        for bm, bn, nw, ns in [
            (128, 64, 8, 3),
            (128, 64, 8, 2),
            (128, 128, 8, 2),
            (64, 64, 4, 3),
            (128, 32, 4, 3),
            (128, 64, 4, 3),
            (64, 128, 4, 2),
            (256, 64, 8, 2),
        ]:
            cfg = {"pack_gqa": pack, "block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns}
            try:
                t = time_fn([ours(i, **cfg) for i in range(2)], 5, 3)
                out.append(cfg | {"us": t * 1e6})
            except Exception as exc:
                out.append(cfg | {"error": str(exc)[:200]})
    log("  extend sweep best:", min((r for r in out if "us" in r), key=lambda r: r["us"], default=None))
    return out


def fi_extend(fi, table, seq, ext, sets, qkv) -> float:
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    ptr, idx, last = fi_pages(table, seq)
    qo = torch.tensor([0] + list(torch.tensor(ext).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    w.plan(qo, ptr, idx, last, HQ, HKV, D, PAGE, causal=True, q_data_type=DT, kv_data_type=DT)
    return (
        time_fn(
            [lambda i=i: w.run(qkv[i][0], (fi_view(sets[i][0]), fi_view(sets[i][1]))) for i in range(2)],
            10,
            5,
            label="flashinfer prefill",
        )
        * 1e6
    )


def correctness(kinds: tuple[str, ...] = ("decode", "extend", "cascade", "fp8", "other")) -> list:
    """Every kernel vs its reference at every benchmark shape (bf16) plus ragged, fp32 and other
    head layouts; a check that raises is recorded as a failure, not fatal."""
    c, f32 = checks, torch.float32
    todo = [
        ("decode", lambda b=b, L=L: c.check_decode(DEV, DT, [L] * b, HQ, HKV, D, [None])) for b, L in DECODE
    ]
    todo += [("extend", lambda p=p, e=e: c.check_extend(DEV, DT, p, e, HQ, HKV, D)) for _, p, e in EXTEND]
    todo += [
        ("decode", lambda: c.check_decode(DEV, DT, [1, 77, 1000, 4097, 333], HQ, HKV, D, [1, 3, None])),
        ("decode", lambda: c.check_decode(DEV, f32, [1, 77, 1000, 333], HQ, HKV, D, [1, 5])),
        ("decode", lambda: c.check_decode(DEV, DT, [5, 300, 2000], 9, 3, 64, [None])),  # SmolLM2 heads
        ("extend", lambda: c.check_extend(DEV, DT, [0, 17, 300, 5, 1000], [20, 1, 0, 377, 129], HQ, HKV, D)),
        ("extend", lambda: c.check_extend(DEV, f32, [0, 17, 300], [20, 1, 177], HQ, HKV, D, 32, 32, 4)),
        ("extend", lambda: c.check_extend(DEV, DT, [3, 0, 250], [100, 64, 7], 9, 3, 64)),
        ("cascade", lambda: c.check_cascade(DEV, DT, [64], [8192], [256] * 64, HQ, HKV, D)),
        (
            "cascade",
            lambda: c.check_cascade(
                DEV, DT, [3, 1, 5], [500, 0, 130], [7, 1, 40, 3, 9, 100, 2, 2, 60], HQ, HKV, D
            ),
        ),
        (
            "cascade",
            lambda: c.check_cascade(
                DEV,
                DT,
                [40, 1, 1, 20],
                [3000, 0, 0, 1000],
                [1 + (7 * i) % 300 for i in range(62)],
                HQ,
                HKV,
                D,
            ),
        ),
        ("cascade", lambda: c.check_cascade(DEV, f32, [5, 1], [700, 0], [1, 60, 3, 9, 200, 900], HQ, HKV, D)),
        ("fp8", lambda: kv_fp8_checks.check_decode_fp8(DEV, DT, [4096] * 64, HQ, HKV, D, [None])),
        ("fp8", lambda: kv_fp8_checks.check_decode_fp8(DEV, DT, [2048] * 128, HQ, HKV, D, [None], unit=True)),
        ("other", lambda: c.check_pointwise(DEV, DT, 300, 4096) + c.check_pointwise(DEV, f32, 33, 576)),
        ("other", lambda: c.check_rotary(DEV, DT, 500, HQ, HKV, D) + c.check_rotary(DEV, f32)),
    ]
    recs = []
    for i, (kind, fn) in enumerate(todo):
        if kind not in kinds:
            continue
        try:
            recs += fn()
        except Exception as exc:
            recs.append((f"check #{i} raised {type(exc).__name__}: {str(exc)[:300]}", math.inf, 0.0))
    return recs


def load_flashinfer():
    try:
        import flashinfer

        return flashinfer
    except Exception:
        log("flashinfer unavailable:", traceback.format_exc(limit=1))
        return None


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    groups = [
        ("decode (µs, lower is better)", res.get("decode", []), "ours_us", "flashinfer_us", "roofline_us"),
        ("extend (µs, lower is better)", res.get("extend", []), "ours_us", "flashinfer_us", "roofline_us"),
    ]
    for ax, (title, rows, o, f, r) in zip(axes, groups):
        x = range(len(rows))
        for j, (key, lab) in enumerate(
            [(o, "radixlm Triton (current defaults)"), (f, "FlashInfer 0.7.4"), (r, "roofline")]
        ):
            vals = [
                row.get("ours_current_default_us", row.get(key, 0)) if key == o else row.get(key, 0)
                for row in rows
            ]
            ax.bar([i + (j - 1) * 0.27 for i in x], vals, 0.27, label=lab)
        ax.set_xticks(list(x), [row["shape"] for row in rows], rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    c = res.get("cascade", {})
    keys = [
        ("plain_us", "plain decode (ours)"),
        ("flashinfer_plain_us", "plain decode (FlashInfer)"),
        ("cascade_two_launch_us", "cascade two-launch"),
        ("cascade_us", "cascade (ours)"),
        ("roofline_plain_us", "roofline plain"),
        ("roofline_cascade_us", "roofline cascade"),
    ]
    axes[2].bar(
        [lab for _, lab in keys], [c.get(k, 0) for k, _ in keys], color=["C0", "C1", "C3", "C2", "C7", "C7"]
    )
    if "speedup_vs_plain" in c:
        axes[2].set_title(f"cascade: {c['shape']} (µs), {c['speedup_vs_plain']:.1f}x")
    axes[2].tick_params(axis="x", rotation=25, labelsize=8)
    fig.suptitle(f"{res['gpu']} · Hq {HQ} / Hkv {HKV} / D {D} bf16 · cold L2, launch cost hidden")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(out_dir: str, sweep: bool, only: list[str]) -> None:
    torch.manual_seed(0)
    import triton

    kinds = only or ["decode", "extend", "cascade", "fp8"]
    fi = load_flashinfer()
    res = {
        "gpu": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "flashinfer": getattr(fi, "__version__", None),
            "cuda": torch.version.cuda,
        },
        "config": {
            "Hq": HQ,
            "Hkv": HKV,
            "D": D,
            "dtype": "bf16",
            "flashinfer_page_size": PAGE,
            "only": kinds,
            "timing": "median of 7 trials (3 in sweeps), each one CUDA-graph replay of 40 calls (10 for "
            "extend; 20/5 in sweeps) between CUDA events, rotating buffer sets totalling >= 180 MB "
            "(cold L2); *_eager_us: the same calls queued without a graph",
        },
    }
    t0 = time.time()
    res["ceilings"] = ceilings()
    log("ceilings", res["ceilings"])
    recs = correctness(tuple(kinds) + (() if only else ("other",)))
    res["correctness"] = [{"check": a, "rel_err": e, "bound": b, "ok": e <= b} for a, e, b in recs]
    bad = [r for r in res["correctness"] if not r["ok"]]
    log(f"correctness: {len(recs) - len(bad)}/{len(recs)} ok ({time.time() - t0:.0f} s)", *bad, sep="\n  ")
    bw, tf = res["ceilings"]["copy_TBps"] * 1e12, res["ceilings"]["bf16_matmul_TFLOPs"]
    benches = {
        "decode": lambda: bench_decode(fi, bw, sweep),
        "extend": lambda: bench_extend(fi, tf, bw, sweep),
        "cascade": lambda: bench_cascade(fi, bw, sweep),
        "fp8": lambda: bench_fp8_decode(fi, bw, sweep),
    }
    for key in kinds:
        try:
            res[key] = benches[key]()
        except Exception:  # keep what was measured; the error is part of the result
            res[key] = {"error": traceback.format_exc(limit=3)} if key == "cascade" else []
            res.setdefault("errors", []).append(traceback.format_exc(limit=3))
            log(res["errors"][-1])
    res["graph_capture_failures"] = GRAPH_FAILURES
    if sweep:
        current_defaults(res)
    summarize(res)
    name = "kernels_h200" + ("_" + "_".join(only) if only else "")
    Path(out_dir).mkdir(parents=True, exist_ok=True)  # a run's minutes are not lost to a missing folder
    with open(f"{out_dir}/{name}.json", "w") as fh:
        json.dump(res, fh, indent=1)
    try:
        plot(res, f"{out_dir}/{name}.png")
    except Exception:
        log("plot failed:", traceback.format_exc(limit=2))
    log(f"total {time.time() - t0:.0f} s")


def best_of(row: dict) -> dict | None:
    return min((r for r in row.get("sweep", []) if "us" in r), key=lambda r: r["us"], default=None)


def summarize(res: dict) -> None:
    """Ratios with the code's default config, and with the best config of this run's sweep."""
    res["ratios"] = {}
    for kind in ("decode", "extend"):
        for r in res.get(kind, []):
            best = best_of(r)
            if best is not None:
                r["best_config"], r["ours_best_us"] = {k: v for k, v in best.items() if k != "us"}, best["us"]
            if "flashinfer_us" in r:
                res["ratios"][f"{kind} {r['shape']} ours/FI (run's default)"] = (
                    r["flashinfer_us"] / r["ours_us"]
                )
                if "ours_current_default_us" in r:
                    res["ratios"][f"{kind} {r['shape']} ours/FI (current default)"] = (
                        r["flashinfer_us"] / r["ours_current_default_us"]
                    )
                if best is not None:
                    res["ratios"][f"{kind} {r['shape']} ours/FI (best swept)"] = (
                        r["flashinfer_us"] / best["us"]
                    )
            ours = r.get("ours_current_default_us", r["ours_us"])
            res["ratios"][f"{kind} {r['shape']} fraction of roofline"] = r["roofline_us"] / ours
    c = res.get("cascade", {})
    if "speedup_vs_plain" in c:
        res["ratios"]["cascade speedup vs plain decode (ours)"] = c["speedup_vs_plain"]
        res["ratios"]["cascade speedup vs plain decode's no-reuse roofline"] = (
            c["roofline_plain_us"] / c["cascade_us"]
        )
        if "flashinfer_plain_us" in c:
            res["ratios"]["cascade speedup vs plain decode (FlashInfer)"] = (
                c["flashinfer_plain_us"] / c["cascade_us"]
            )
        if "cascade_two_launch_us" in c:
            res["ratios"]["cascade speedup vs plain decode (two-launch impl)"] = (
                c["plain_us"] / c["cascade_two_launch_us"]
            )
        if "cascade_best_us" in c:
            res["ratios"]["cascade speedup vs plain decode (best swept)"] = (
                c["plain_us"] / c["cascade_best_us"]
            )
        res["ratios"]["cascade fraction of its roofline"] = c["roofline_cascade_us"] / c["cascade_us"]
    res["ratios"].update(fp8_ratios(res.get("fp8", [])))
    for k, v in res["ratios"].items():
        log(f"{k:55s} {v:6.2f}")
    log("graph capture failures:", res.get("graph_capture_failures", GRAPH_FAILURES))


def current_defaults(res: dict) -> None:
    """Attach, per shape, the sweep entry that matches the kernels' current default config
    (so defaults chosen from a run's sweep are reported with that run's numbers)."""
    for r in res.get("decode", []):
        want = {
            "block_n": 64,
            "num_warps": 4,
            "num_stages": 3,
            "splits": choose_num_splits(r["batch"], HKV, r["len"]),
        }
        hit = [e for e in r.get("sweep", []) if "us" in e and all(e[k] == v for k, v in want.items())]
        if hit:
            r["current_default"], r["ours_current_default_us"] = want, hit[0]["us"]
    for r in res.get("extend", []):
        ext = next(e for name, _, e in EXTEND if name == r["shape"])
        want = {"pack_gqa": True} | extend_config(max(ext))
        hit = [e for e in r.get("sweep", []) if "us" in e and all(e[k] == v for k, v in want.items())]
        if hit:
            r["current_default"], r["ours_current_default_us"] = want, hit[0]["us"]


def rooflines(res: dict, bw: float) -> None:
    tf = res["ceilings"]["bf16_matmul_TFLOPs"] * 1e12
    for r in res.get("decode", []):
        r["roofline_us"] = (r["kv_bytes"] + 2 * r["batch"] * HQ * D * 2) / bw * 1e6
    for r in res.get("extend", []):
        prefix, ext = next((p, e) for name, p, e in EXTEND if name == r["shape"])
        r["roofline_us"] = max(r["flops"] / tf, 2 * (sum(prefix) + sum(ext)) * HKV * D * 2 / bw) * 1e6
    c = res.get("cascade", {})
    c["roofline_plain_us"] = 2 * 64 * (8192 + 256) * HKV * D * 2 / bw * 1e6
    c["roofline_cascade_us"] = 2 * (8192 + 64 * 256) * HKV * D * 2 / bw * 1e6


def reanalyze(path: str, out_dir: str, copy_tbps: float, note: str) -> None:
    """Re-derive rooflines (with a corrected copy bandwidth) and current-default ratios from a
    saved run, and redraw the plot; every measured time stays as measured."""
    with open(path) as fh:
        res = json.load(fh)
    res["ceilings"]["copy_TBps_as_measured"] = res["ceilings"]["copy_TBps"]
    res["ceilings"]["copy_TBps"], res["ceilings"]["note"] = copy_tbps, note
    rooflines(res, copy_tbps * 1e12)
    current_defaults(res)
    summarize(res)
    with open(f"{out_dir}/kernels_h200.json", "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, f"{out_dir}/kernels_h200.png")


def parse_args(argv: list[str]):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default="benchmarks/results", help="where the JSON and PNG go")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile / split knobs (adds a few minutes)")
    ap.add_argument(
        "--only",
        default="",
        help="comma list of decode,extend,cascade,fp8: run just those benchmarks "
        "(and their correctness checks); writes kernels_h200_<only>.json so a full run is not overwritten",
    )
    ap.add_argument(
        "--decode-shapes",
        default="",
        help="comma list of BATCH:LEN, the decode shapes to run instead of the default list",
    )
    ap.add_argument(
        "--reanalyze",
        nargs=4,
        metavar=("RUN_JSON", "OUT", "COPY_TBPS", "NOTE"),
        help="re-derive rooflines/ratios of a saved run with a corrected copy bandwidth (CPU is fine)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: run the cascade sweep configs under "
        "TRITON_INTERPRET=1 at a tiny version of the benchmark shape against the torch reference",
    )
    args = ap.parse_args(argv)
    args.only = [k for k in args.only.split(",") if k]
    try:
        args.decode_shapes = [tuple(int(v) for v in s.split(":")) for s in args.decode_shapes.split(",") if s]
    except ValueError:
        ap.error(f"--decode-shapes: want BATCH:LEN,..., got {args.decode_shapes!r}")
    if any(len(s) != 2 or min(s) < 1 for s in args.decode_shapes):
        ap.error(f"--decode-shapes: want positive BATCH:LEN pairs, got {args.decode_shapes!r}")
    kinds = {"decode", "extend", "cascade", "fp8"}
    if set(args.only) - kinds:
        ap.error(f"--only: unknown {sorted(set(args.only) - kinds)}")
    return args


if __name__ == "__main__":
    ARGS = parse_args(sys.argv[1:])
    if ARGS.reanalyze:
        run_json, out, tbps, note = ARGS.reanalyze
        reanalyze(run_json, out, float(tbps), note)
    elif ARGS.dry_run:
        dry_run(__file__, summarize, plot)
    else:
        DECODE[:] = ARGS.decode_shapes or DECODE
        main(ARGS.out_dir, ARGS.sweep, ARGS.only)
