"""Kernel benchmark for the H200 (issue 7): our Triton kernels vs FlashInfer 0.7.4 (a yardstick,
never a dependency) vs the memory / tensor-core roofline measured in the same run, Hq 32 / Hkv 8 /
D 128 bf16. Checks every kernel against its torch reference at every shape first. Cold L2
(rotating buffer sets > 180 MB), launch cost hidden (back-to-back calls between CUDA events).
Writes OUT/kernels_h200.json and OUT/kernels_h200.png.  Usage: python benchmarks/kernels.py OUT [--sweep]"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from radixlm.kernels import checks
from radixlm.kernels.cascade_attention import cascade_decode_attention, make_cascade_plan
from radixlm.kernels.decode_attention import choose_num_splits, decode_attention
from radixlm.kernels.extend_attention import extend_attention, extend_config

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
DEV = "cuda"
DECODE = [(1, 4096), (64, 4096), (128, 2048), (256, 1024), (32, 16384)]
EXTEND = [("B=8 2048+512", [2048] * 8, [512] * 8), ("B=32 1024+128", [1024] * 32, [128] * 32),
          ("one 8192 prompt", [0], [8192])]
L2_BYTES = 60e6


def log(*a: object, **kw: object) -> None:
    print(*a, **kw, flush=True)


GRAPH_FAILURES: list[str] = []


def time_fn(fns: list[Callable[[], object]], reps: int = 40, trials: int = 7, graph: bool = True,
            label: str = "") -> float:
    """Median seconds per call. Each trial replays a CUDA graph of `reps` calls rotating over `fns`
    (launch cost hidden); if capture fails, the same calls are queued eagerly between events."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    run = None
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for f in fns:
                    f()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(reps):
                    fns[i % len(fns)]()
            run = g.replay
        except Exception as exc:
            GRAPH_FAILURES.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            torch.cuda.synchronize()
    if run is None:
        def run() -> None:
            for i in range(reps):
                fns[i % len(fns)]()
    run()
    out = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(out)


def n_sets(bytes_per_set: float) -> int:
    return max(2, math.ceil(3 * L2_BYTES / bytes_per_set))


def ceilings() -> dict:
    x = torch.empty(int(2e9), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    t = time_fn([lambda: y.copy_(x)], reps=10, trials=5, graph=False)  # a graph turns it into a DMA memcpy
    a = torch.randn(8192, 8192, dtype=DT, device=DEV)
    bm = torch.randn(8192, 8192, dtype=DT, device=DEV)
    tm = time_fn([lambda: a @ bm], reps=10, trials=5)
    return {"copy_TBps": 4e9 / t / 1e12, "bf16_matmul_TFLOPs": 2 * 8192**3 / tm / 1e12}


def paged_table(seq_lens: list[int], scattered: bool = False, shared: int = 0) -> tuple[torch.Tensor, int]:
    """req_to_token whose rows map to whole 16-token pages (page p = slots 1+16p..16p+16) in a
    random page order — the same bytes FlashInfer reads at page size 16 — or to scattered single
    slots. With shared > 0 every row starts with the same `shared` slots."""
    pages_per = [math.ceil((L - shared) / PAGE) for L in seq_lens]
    shared_pages = math.ceil(shared / PAGE)
    n_pages = sum(pages_per) + shared_pages
    order = torch.randperm(n_pages, device=DEV)
    slots_all = (order[:, None] * PAGE + 1 + torch.arange(PAGE, device=DEV)).flatten()
    if scattered:
        slots_all = slots_all[torch.randperm(slots_all.numel(), device=DEV)]
    table = torch.zeros(len(seq_lens), max(seq_lens) + PAGE, dtype=torch.int64, device=DEV)
    pre = slots_all[: shared_pages * PAGE]
    used = shared_pages * PAGE
    for b in range(len(seq_lens)):
        own = pages_per[b] * PAGE
        table[b, :shared] = pre[:shared]
        table[b, shared : shared + own] = slots_all[used : used + own]
        used += own
    return table, n_pages * PAGE + 1


def fi_pages(table: torch.Tensor, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer page table (indptr, indices, last_page_len) for a paged_table (whole pages)."""
    idx, ptr, last = [], [0], []
    for b, L in enumerate(seq_lens):
        n = math.ceil(L / PAGE)
        idx.append((table[b, : n * PAGE : PAGE] - 1) // PAGE)
        ptr.append(ptr[-1] + n)
        last.append(L - (n - 1) * PAGE)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    return i32(ptr), torch.cat(idx).to(torch.int32), i32(last)


def kv_sets(n_slots: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(n_slots, HKV, D, dtype=DT, device=DEV), torch.randn(n_slots, HKV, D, dtype=DT, device=DEV))
            for _ in range(count)]


def fi_view(buf: torch.Tensor) -> torch.Tensor:
    return buf[1:].view(-1, PAGE, HKV, D)


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

    row = {"shape": f"B={bsz} L={L}", "batch": bsz, "len": L, "kv_bytes": kv_bytes, "splits": splits,
           "roofline_us": (kv_bytes + 2 * bsz * HQ * D * 2) / bw * 1e6}
    row["ours_us"] = time_fn([ours(i) for i in range(len(sets))], label="decode") * 1e6
    row["ours_eager_us"] = time_fn([ours(i) for i in range(len(sets))], graph=False) * 1e6
    scat, _ = paged_table(seq, scattered=True)
    row["ours_scattered_slots_us"] = time_fn([ours(i, table=scat) for i in range(len(sets))]) * 1e6
    if sweep:
        row["sweep"] = sweep_decode(ours, len(sets), splits)
    if fi is not None:
        row["flashinfer_us"] = fi_decode(fi, table, seq, sets, qs)
        row["flashinfer_eager_us"] = fi_decode(fi, table, seq, sets, qs, graph=False)
    row["ours_TBps"] = kv_bytes / row["ours_us"] / 1e6
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    return row


def sweep_decode(ours, n: int, splits: int) -> list[dict]:
    out = []
    for bn, nw, ns in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (64, 2, 2),
                       (32, 2, 3), (128, 8, 3)]:
        for s in sorted({max(1, splits // 2), splits, splits * 2, splits * 4}):
            try:
                t = time_fn([ours(i, s, block_n=bn, num_warps=nw, num_stages=ns) for i in range(n)], 20, 3)
                out.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "splits": s, "us": t * 1e6})
            except Exception as exc:  # a config that does not compile is recorded, not fatal
                out.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "splits": s, "error": str(exc)[:200]})
    best = min((r for r in out if "us" in r), key=lambda r: r["us"], default=None)
    log("  decode sweep best:", best)
    return out


def fi_decode(fi, table, seq, sets, qs, graph: bool = True) -> float:
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    ptr, idx, last = fi_pages(table, seq)
    w.plan(ptr, idx, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
    return time_fn([lambda i=i: w.run(qs[i], (fi_view(sets[i][0]), fi_view(sets[i][1]))) for i in range(len(sets))],
                   graph=graph, label="flashinfer decode") * 1e6


def extend_flops(prefix: list[int], ext: list[int]) -> float:
    return 4.0 * D * HQ * sum(e * p + e * (e + 1) / 2 for p, e in zip(prefix, ext))


def bench_extend(fi, tflops: float, bw: float, sweep: bool) -> list[dict]:
    return [extend_shape(fi, tflops, bw, sweep, name, prefix, ext) for name, prefix, ext in EXTEND]


def extend_shape(fi, tflops: float, bw: float, sweep: bool, name: str, prefix: list[int], ext: list[int]) -> dict:
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
        return lambda: extend_attention(q, k, v, sets[i][0], sets[i][1], table, ridx, pl, el, starts, max(ext), **kw)

    flops = extend_flops(prefix, ext)
    row = {"shape": name, "flops": flops, "roofline_us": max(flops / tflops / 1e12,
           2 * sum(seq) * HKV * D * 2 / bw) * 1e6, "ours_us": time_fn([ours(i) for i in range(2)], 10, 5, label="extend") * 1e6}
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
        for bm, bn, nw, ns in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
                               (128, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2)]:
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
    return time_fn([lambda i=i: w.run(qkv[i][0], (fi_view(sets[i][0]), fi_view(sets[i][1]))) for i in range(2)],
                   10, 5, label="flashinfer prefill") * 1e6


def bench_cascade(fi, bw: float, sweep: bool, bsz: int = 64, shared: int = 8192, own: int = 256) -> dict:
    seq = [shared + own] * bsz
    table, n_slots = paged_table(seq, shared=shared)
    set_bytes = 2 * (shared + bsz * own) * HKV * D * 2
    sets = kv_sets(n_slots, n_sets(set_bytes))
    qs = [torch.randn(bsz, HQ, D, dtype=DT, device=DEV) for _ in sets]
    lens = torch.tensor(seq, device=DEV)
    ridx = torch.arange(bsz, device=DEV)
    plan = make_cascade_plan([bsz], [shared], seq, DEV)
    rec = checks.rel_err(cascade_decode_attention(qs[0], *sets[0], table, ridx, lens, plan),
                         decode_attention(qs[0], *sets[0], table, ridx, lens, max_len=seq[0]).float())
    splits = choose_num_splits(bsz, HKV, seq[0], torch.cuda.get_device_properties(0).multi_processor_count)
    row = {"shape": f"{bsz} reqs, shared {shared} + own {own}", "cascade_vs_plain_rel_err": rec,
           "plain_us": time_fn([lambda i=i: decode_attention(qs[i], *sets[i], table, ridx, lens, num_splits=splits)
                                for i in range(len(sets))], label="plain decode") * 1e6,
           "roofline_plain_us": 2 * bsz * seq[0] * HKV * D * 2 / bw * 1e6, "roofline_cascade_us": set_bytes / bw * 1e6}

    def casc(i, **kw):
        return lambda: cascade_decode_attention(qs[i], *sets[i], table, ridx, lens, plan, **kw)

    row["cascade_us"] = time_fn([casc(i) for i in range(len(sets))], label="cascade") * 1e6
    row["cascade_unfused_merge_us"] = time_fn([casc(i, fused_merge=False) for i in range(len(sets))]) * 1e6
    if sweep:
        row["sweep"] = []
        for bm, bn, nw, ns in [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2)]:
            for ss in (None, 16, 32):
                cfg = {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns, "shared_splits": ss}
                try:
                    t = time_fn([casc(i, **cfg) for i in range(len(sets))], 20, 3)
                    row["sweep"].append(cfg | {"us": t * 1e6})
                except Exception as exc:
                    row["sweep"].append(cfg | {"error": str(exc)[:200]})
        log("  cascade sweep best:", min((r for r in row["sweep"] if "us" in r), key=lambda r: r["us"], default=None))
    if fi is not None:
        row["flashinfer_plain_us"] = fi_decode(fi, table, seq, sets, qs)
    row["speedup_vs_plain"] = row["plain_us"] / row["cascade_us"]
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    return row


def correctness() -> list:
    """Every kernel vs its reference at every benchmark shape (bf16) plus ragged, fp32 and other
    head layouts; a check that raises is recorded as a failure, not fatal."""
    c, f32 = checks, torch.float32
    todo = [lambda b=b, L=L: c.check_decode(DEV, DT, [L] * b, HQ, HKV, D, [None]) for b, L in DECODE]
    todo += [lambda p=p, e=e: c.check_extend(DEV, DT, p, e, HQ, HKV, D) for _, p, e in EXTEND]
    todo += [
        lambda: c.check_decode(DEV, DT, [1, 77, 1000, 4097, 333], HQ, HKV, D, [1, 3, None]),
        lambda: c.check_decode(DEV, f32, [1, 77, 1000, 333], HQ, HKV, D, [1, 5]),
        lambda: c.check_decode(DEV, DT, [5, 300, 2000], 9, 3, 64, [None]),  # SmolLM2 heads
        lambda: c.check_extend(DEV, DT, [0, 17, 300, 5, 1000], [20, 1, 0, 377, 129], HQ, HKV, D),
        lambda: c.check_extend(DEV, f32, [0, 17, 300], [20, 1, 177], HQ, HKV, D, 32, 32, 4),
        lambda: c.check_extend(DEV, DT, [3, 0, 250], [100, 64, 7], 9, 3, 64),
        lambda: c.check_cascade(DEV, DT, [64], [8192], [256] * 64, HQ, HKV, D),
        lambda: c.check_cascade(DEV, DT, [3, 1, 5], [500, 0, 130], [7, 1, 40, 3, 9, 100, 2, 2, 60], HQ, HKV, D),
        lambda: c.check_pointwise(DEV, DT, 300, 4096) + c.check_pointwise(DEV, f32, 33, 576),
        lambda: c.check_rotary(DEV, DT, 500, HQ, HKV, D) + c.check_rotary(DEV, f32),
        lambda: c.check_sampling(DEV, 64, 128256, 2) + c.check_sampling_distribution(DEV, 4000),
    ]
    recs = []
    for i, fn in enumerate(todo):
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
    groups = [("decode (µs, lower is better)", res["decode"], "ours_us", "flashinfer_us", "roofline_us"),
              ("extend (µs, lower is better)", res["extend"], "ours_us", "flashinfer_us", "roofline_us")]
    for ax, (title, rows, o, f, r) in zip(axes, groups):
        x = range(len(rows))
        for j, (key, lab) in enumerate([(o, "radixlm Triton (current defaults)"), (f, "FlashInfer 0.7.4"), (r, "roofline")]):
            vals = [row.get("ours_current_default_us", row.get(key, 0)) if key == o else row.get(key, 0) for row in rows]
            ax.bar([i + (j - 1) * 0.27 for i in x], vals, 0.27, label=lab)
        ax.set_xticks(list(x), [row["shape"] for row in rows], rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    c = res["cascade"]
    keys = [("plain_us", "plain decode (ours)"), ("flashinfer_plain_us", "plain decode (FlashInfer)"),
            ("cascade_us", "cascade (ours)"), ("roofline_plain_us", "roofline plain"), ("roofline_cascade_us", "roofline cascade")]
    axes[2].bar([lab for _, lab in keys], [c.get(k, 0) for k, _ in keys], color=["C0", "C1", "C2", "C7", "C7"])
    axes[2].set_title(f"cascade: {c['shape']} (µs), {c['speedup_vs_plain']:.1f}x")
    axes[2].tick_params(axis="x", rotation=25, labelsize=8)
    fig.suptitle(f"{res['gpu']} · Hq {HQ} / Hkv {HKV} / D {D} bf16 · cold L2, launch cost hidden")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"
    sweep = "--sweep" in sys.argv
    torch.manual_seed(0)
    import triton

    fi = load_flashinfer()
    res = {"gpu": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                        "flashinfer": getattr(fi, "__version__", None), "cuda": torch.version.cuda},
           "config": {"Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bf16", "flashinfer_page_size": PAGE,
                      "timing": "median of 7 trials (3 in sweeps), each one CUDA-graph replay of 40 calls (10 for "
                                "extend; 20/5 in sweeps) between CUDA events, rotating buffer sets totalling >= 180 MB "
                                "(cold L2); *_eager_us: the same calls queued without a graph"}}
    t0 = time.time()
    res["ceilings"] = ceilings()
    log("ceilings", res["ceilings"])
    recs = correctness()
    res["correctness"] = [{"check": a, "rel_err": e, "bound": b, "ok": e <= b} for a, e, b in recs]
    bad = [r for r in res["correctness"] if not r["ok"]]
    log(f"correctness: {len(recs) - len(bad)}/{len(recs)} ok ({time.time() - t0:.0f} s)", *bad, sep="\n  ")
    bw, tf = res["ceilings"]["copy_TBps"] * 1e12, res["ceilings"]["bf16_matmul_TFLOPs"]
    for key, fn in (("decode", lambda: bench_decode(fi, bw, sweep)), ("extend", lambda: bench_extend(fi, tf, bw, sweep)),
                    ("cascade", lambda: bench_cascade(fi, bw, sweep))):
        try:
            res[key] = fn()
        except Exception:  # keep what was measured; the error is part of the result
            res[key] = {"error": traceback.format_exc(limit=3)} if key == "cascade" else []
            res.setdefault("errors", []).append(traceback.format_exc(limit=3))
            log(res["errors"][-1])
    res["graph_capture_failures"] = GRAPH_FAILURES
    if sweep:
        current_defaults(res)
    summarize(res)
    with open(f"{out_dir}/kernels_h200.json", "w") as fh:
        json.dump(res, fh, indent=1)
    try:
        plot(res, f"{out_dir}/kernels_h200.png")
    except Exception:
        log("plot failed:", traceback.format_exc(limit=2))
    log(f"total {time.time() - t0:.0f} s")


def best_of(row: dict) -> dict | None:
    return min((r for r in row.get("sweep", []) if "us" in r), key=lambda r: r["us"], default=None)


def summarize(res: dict) -> None:
    """Ratios with the code's default config, and with the best config of this run's sweep."""
    res["ratios"] = {}
    for kind in ("decode", "extend"):
        for r in res[kind]:
            best = best_of(r)
            if best is not None:
                r["best_config"], r["ours_best_us"] = {k: v for k, v in best.items() if k != "us"}, best["us"]
            if "flashinfer_us" in r:
                res["ratios"][f"{kind} {r['shape']} ours/FI (run's default)"] = r["flashinfer_us"] / r["ours_us"]
                if "ours_current_default_us" in r:
                    res["ratios"][f"{kind} {r['shape']} ours/FI (current default)"] = (
                        r["flashinfer_us"] / r["ours_current_default_us"])
                if best is not None:
                    res["ratios"][f"{kind} {r['shape']} ours/FI (best swept)"] = r["flashinfer_us"] / best["us"]
            ours = r.get("ours_current_default_us", r["ours_us"])
            res["ratios"][f"{kind} {r['shape']} fraction of roofline"] = r["roofline_us"] / ours
    c = res["cascade"]
    if "speedup_vs_plain" in c:
        res["ratios"]["cascade speedup vs plain decode (ours)"] = c["speedup_vs_plain"]
        res["ratios"]["cascade speedup vs plain decode's no-reuse roofline"] = c["roofline_plain_us"] / c["cascade_us"]
        if "flashinfer_plain_us" in c:
            res["ratios"]["cascade speedup vs plain decode (FlashInfer)"] = c["flashinfer_plain_us"] / c["cascade_us"]
    for k, v in res["ratios"].items():
        log(f"{k:55s} {v:6.2f}")
    log("graph capture failures:", res.get("graph_capture_failures", GRAPH_FAILURES))


def current_defaults(res: dict) -> None:
    """Attach, per shape, the sweep entry that matches the kernels' current default config
    (so defaults chosen from a run's sweep are reported with that run's numbers)."""
    for r in res["decode"]:
        want = {"block_n": 64, "num_warps": 4, "num_stages": 3, "splits": choose_num_splits(r["batch"], HKV, r["len"])}
        hit = [e for e in r.get("sweep", []) if "us" in e and all(e[k] == v for k, v in want.items())]
        if hit:
            r["current_default"], r["ours_current_default_us"] = want, hit[0]["us"]
    for r in res["extend"]:
        ext = next(e for name, _, e in EXTEND if name == r["shape"])
        want = {"pack_gqa": True} | extend_config(max(ext))
        hit = [e for e in r.get("sweep", []) if "us" in e and all(e[k] == v for k, v in want.items())]
        if hit:
            r["current_default"], r["ours_current_default_us"] = want, hit[0]["us"]


def rooflines(res: dict, bw: float) -> None:
    tf = res["ceilings"]["bf16_matmul_TFLOPs"] * 1e12
    for r in res["decode"]:
        r["roofline_us"] = (r["kv_bytes"] + 2 * r["batch"] * HQ * D * 2) / bw * 1e6
    for r in res["extend"]:
        prefix, ext = next((p, e) for name, p, e in EXTEND if name == r["shape"])
        r["roofline_us"] = max(r["flops"] / tf, 2 * (sum(prefix) + sum(ext)) * HKV * D * 2 / bw) * 1e6
    c = res["cascade"]
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


if __name__ == "__main__":
    if "--reanalyze" in sys.argv:  # kernels.py --reanalyze RUN.json OUT COPY_TBPS NOTE
        i = sys.argv.index("--reanalyze")
        reanalyze(sys.argv[i + 1], sys.argv[i + 2], float(sys.argv[i + 3]), sys.argv[i + 4])
    else:
        main()
