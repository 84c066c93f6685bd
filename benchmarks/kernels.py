"""Kernel benchmark for the H200 (issue 7): our Triton kernels vs FlashInfer 0.7.4 (a yardstick,
never a dependency) vs the memory / tensor-core roofline measured in the same run, Hq 32 / Hkv 8 /
D 128 bf16. Checks every kernel against its torch reference at every shape first. Cold L2
(rotating buffer sets > 180 MB), launch cost hidden (back-to-back calls between CUDA events).
Writes OUT/kernels_h200.json and OUT/kernels_h200.png (OUT/kernels_h200_<only>.* with --only).
Usage: python benchmarks/kernels.py OUT [--sweep] [--only cascade]; CPU: --dry-run, --reanalyze, --help."""

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

from radixlm.kernels import cascade_attention as cas
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


# Fused-cascade sweep: (block_m, block_n, num_warps, num_stages) tiles x shared_waves (shared-prefix
# programs per SM); the best few are then retried own-first and with other own_block_n.
CASCADE_TILES = [(64, 64, 4, 3), (64, 32, 4, 3), (64, 32, 4, 2), (64, 16, 4, 3), (64, 64, 4, 2), (64, 32, 8, 3),
                 (64, 64, 8, 3), (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2)]
CASCADE_WAVES = [0.5, 0.75, 1.0, 1.5, 2.0, 3.0]


def cascade_inputs(bsz: int, shared: int, own: int) -> dict:
    seq = [shared + own] * bsz
    table, n_slots = paged_table(seq, shared=shared)
    set_bytes = 2 * (shared + bsz * own) * HKV * D * 2
    sets = kv_sets(n_slots, n_sets(set_bytes))
    return {"seq": seq, "table": table, "set_bytes": set_bytes, "sets": sets,
            "qs": [torch.randn(bsz, HQ, D, dtype=DT, device=DEV) for _ in sets],
            "lens": torch.tensor(seq, device=DEV), "ridx": torch.arange(bsz, device=DEV),
            "plan": make_cascade_plan([bsz], [shared], seq, DEV)}


def bench_cascade(fi, bw: float, sweep: bool, bsz: int = 64, shared: int = 8192, own: int = 256) -> dict:
    x = cascade_inputs(bsz, shared, own)
    seq, table, sets, qs, lens, ridx, plan = (x[k] for k in ("seq", "table", "sets", "qs", "lens", "ridx", "plan"))
    n = len(sets)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plain0 = decode_attention(qs[0], *sets[0], table, ridx, lens, max_len=seq[0]).float()

    def casc(i, **kw):
        return lambda: cascade_decode_attention(qs[i], *sets[i], table, ridx, lens, plan, **kw)

    def err(**kw) -> float:
        return checks.rel_err(casc(0, **kw)(), plain0)

    splits = choose_num_splits(bsz, HKV, seq[0], sms)
    row = {"shape": f"{bsz} reqs, shared {shared} + own {own}", "cascade_vs_plain_rel_err": err(),
           "two_launch_vs_plain_rel_err": err(impl="two_launch"), "default_config": dict(cas.FUSED_DEFAULTS),
           "plain_us": time_fn([lambda i=i: decode_attention(qs[i], *sets[i], table, ridx, lens, num_splits=splits)
                                for i in range(n)], label="plain decode") * 1e6,
           "roofline_plain_us": 2 * bsz * seq[0] * HKV * D * 2 / bw * 1e6, "roofline_cascade_us": x["set_bytes"] / bw * 1e6,
           "shared_tflop": 4 * bsz * HQ * shared * D / 1e12}
    row["cascade_us"] = time_fn([casc(i) for i in range(n)], label="cascade fused") * 1e6
    row["cascade_two_launch_us"] = time_fn([casc(i, impl="two_launch") for i in range(n)], label="cascade two") * 1e6
    row["cascade_unfused_merge_us"] = time_fn([casc(i, impl="two_launch", fused_merge=False) for i in range(n)]) * 1e6
    row["parts"] = cascade_parts(x, cas.resolve_config(), sms)
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    if sweep:
        row["sweep"] = sweep_cascade(casc, err, n)
        good = [r for r in row["sweep"] if "us" in r and r["rel_err"] <= 1e-2 and r.get("impl") == "fused"]
        best = min(good, key=lambda r: r["us"], default=None)
        if best is not None:
            cfg = {k: best[k] for k in cas.FUSED_DEFAULTS}
            row["best_config"], row["cascade_best_us"] = cfg, best["us"]
            row["parts_best"] = cascade_parts(x, cas.resolve_config(**cfg), sms)
            log(f"  cascade best swept {best['us']:.1f} us (default {row['cascade_us']:.1f} us); adopt in "
                f"kernels/cascade_attention.py:\n  FUSED_DEFAULTS: dict = {cfg!r}")
    if fi is not None:
        row["flashinfer_plain_us"] = fi_decode(fi, table, seq, sets, qs)
    row["speedup_vs_plain"] = row["plain_us"] / row["cascade_us"]
    row["speedup_vs_plain_best_swept"] = row["plain_us"] / row.get("cascade_best_us", row["cascade_us"])
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    return row


def cascade_parts(x: dict, cfg: dict, sms: int) -> dict:
    """Diagnosis of one fused config: its layout, the fused launch alone, its shared-prefix
    programs alone, its own-tail programs alone, and the merge alone (us)."""
    q0 = x["qs"][0]
    lay = cas.fused_layout(q0.shape[0], HQ, HKV, x["plan"], cfg, sms)
    s = lay.s_sh + lay.s_own
    mids = [(torch.empty(q0.shape[0], HQ, s, D, device=DEV), torch.empty(q0.shape[0], HQ, s, device=DEV))
            for _ in x["sets"]]
    outs = [torch.empty_like(q) for q in x["qs"]]

    def part(i, which):
        return lambda: cas.cascade_partial(x["qs"][i], *x["sets"][i], x["table"], x["ridx"], x["lens"], x["plan"],
                                           lay, *mids[i], 1 / math.sqrt(D), cfg, which)

    n = len(x["sets"])
    res = {"layout": vars(lay) | {"config": cfg}}
    for which in ("all", "shared", "own"):
        res[f"{which}_partial_us"] = time_fn([part(i, which) for i in range(n)], label=f"cascade {which}") * 1e6
    res["merge_us"] = time_fn([lambda i=i: cas.cascade_merge(*mids[i], x["plan"], lay.s_sh, outs[i])
                               for i in range(n)], label="cascade merge") * 1e6
    log("  cascade parts:", json.dumps(res))
    return res


def sweep_cascade(casc, err, n: int) -> list[dict]:
    """Tiles x shared_waves (shared_first, own_block_n = block_n); then the 3 best retried own-first
    and with other own_block_n; and the two-launch impl's best earlier config for reference."""
    out: list[dict] = []

    def one(cfg: dict) -> None:
        try:
            t = time_fn([casc(i, **cfg) for i in range(n)], 20, 3)
            out.append(cfg | {"us": t * 1e6, "rel_err": err(**cfg)})
        except Exception as exc:  # a config that does not compile is recorded, not fatal
            out.append(cfg | {"error": str(exc)[:200]})

    for bm, bn, nw, ns in CASCADE_TILES:
        for w in CASCADE_WAVES:
            one({"impl": "fused", "block_m": bm, "block_n": bn, "own_block_n": None, "num_warps": nw,
                 "num_stages": ns, "shared_waves": w, "shared_first": True})
    top = sorted((r for r in out if "us" in r), key=lambda r: r["us"])[:3]
    for r in top:
        base = {k: r[k] for k in ("impl", *cas.FUSED_DEFAULTS)}
        one(base | {"shared_first": False})
        for obn in (32, 128):
            if obn != r["block_n"]:
                one(base | {"own_block_n": obn})
    for ss in (None, 16):
        one({"impl": "two_launch", "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "shared_splits": ss})
    return out


def correctness(kinds: tuple[str, ...] = ("decode", "extend", "cascade", "other")) -> list:
    """Every kernel vs its reference at every benchmark shape (bf16) plus ragged, fp32 and other
    head layouts; a check that raises is recorded as a failure, not fatal."""
    c, f32 = checks, torch.float32
    todo = [("decode", lambda b=b, L=L: c.check_decode(DEV, DT, [L] * b, HQ, HKV, D, [None])) for b, L in DECODE]
    todo += [("extend", lambda p=p, e=e: c.check_extend(DEV, DT, p, e, HQ, HKV, D)) for _, p, e in EXTEND]
    todo += [
        ("decode", lambda: c.check_decode(DEV, DT, [1, 77, 1000, 4097, 333], HQ, HKV, D, [1, 3, None])),
        ("decode", lambda: c.check_decode(DEV, f32, [1, 77, 1000, 333], HQ, HKV, D, [1, 5])),
        ("decode", lambda: c.check_decode(DEV, DT, [5, 300, 2000], 9, 3, 64, [None])),  # SmolLM2 heads
        ("extend", lambda: c.check_extend(DEV, DT, [0, 17, 300, 5, 1000], [20, 1, 0, 377, 129], HQ, HKV, D)),
        ("extend", lambda: c.check_extend(DEV, f32, [0, 17, 300], [20, 1, 177], HQ, HKV, D, 32, 32, 4)),
        ("extend", lambda: c.check_extend(DEV, DT, [3, 0, 250], [100, 64, 7], 9, 3, 64)),
        ("cascade", lambda: c.check_cascade(DEV, DT, [64], [8192], [256] * 64, HQ, HKV, D)),
        ("cascade", lambda: c.check_cascade(DEV, DT, [3, 1, 5], [500, 0, 130], [7, 1, 40, 3, 9, 100, 2, 2, 60],
                                            HQ, HKV, D)),
        ("cascade", lambda: c.check_cascade(DEV, DT, [40, 1, 1, 20], [3000, 0, 0, 1000],
                                            [1 + (7 * i) % 300 for i in range(62)], HQ, HKV, D,
                                            variants=cascade_sweep_variants())),
        ("cascade", lambda: c.check_cascade(DEV, f32, [5, 1], [700, 0], [1, 60, 3, 9, 200, 900], HQ, HKV, D)),
        ("other", lambda: c.check_pointwise(DEV, DT, 300, 4096) + c.check_pointwise(DEV, f32, 33, 576)),
        ("other", lambda: c.check_rotary(DEV, DT, 500, HQ, HKV, D) + c.check_rotary(DEV, f32)),
        ("other", lambda: c.check_sampling(DEV, 64, 128256, 2) + c.check_sampling_distribution(DEV, 4000)),
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


def cascade_sweep_variants() -> list[dict]:
    """Every tile of the fused sweep (one shared_waves each), own-first, and the two-launch impl."""
    out = [{"impl": "fused", "block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns,
            "shared_waves": CASCADE_WAVES[i % len(CASCADE_WAVES)]} for i, (bm, bn, nw, ns) in enumerate(CASCADE_TILES)]
    return out + [{"impl": "fused", "shared_first": False, "own_block_n": 32},
                  {"impl": "two_launch", "block_m": 64, "block_n": 64}]


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
    groups = [("decode (µs, lower is better)", res.get("decode", []), "ours_us", "flashinfer_us", "roofline_us"),
              ("extend (µs, lower is better)", res.get("extend", []), "ours_us", "flashinfer_us", "roofline_us")]
    for ax, (title, rows, o, f, r) in zip(axes, groups):
        x = range(len(rows))
        for j, (key, lab) in enumerate([(o, "radixlm Triton (current defaults)"), (f, "FlashInfer 0.7.4"), (r, "roofline")]):
            vals = [row.get("ours_current_default_us", row.get(key, 0)) if key == o else row.get(key, 0) for row in rows]
            ax.bar([i + (j - 1) * 0.27 for i in x], vals, 0.27, label=lab)
        ax.set_xticks(list(x), [row["shape"] for row in rows], rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    c = res.get("cascade", {})
    keys = [("plain_us", "plain decode (ours)"), ("flashinfer_plain_us", "plain decode (FlashInfer)"),
            ("cascade_two_launch_us", "cascade two-launch"), ("cascade_us", "cascade (ours)"),
            ("roofline_plain_us", "roofline plain"), ("roofline_cascade_us", "roofline cascade")]
    axes[2].bar([lab for _, lab in keys], [c.get(k, 0) for k, _ in keys], color=["C0", "C1", "C3", "C2", "C7", "C7"])
    if "speedup_vs_plain" in c:
        axes[2].set_title(f"cascade: {c['shape']} (µs), {c['speedup_vs_plain']:.1f}x")
    axes[2].tick_params(axis="x", rotation=25, labelsize=8)
    fig.suptitle(f"{res['gpu']} · Hq {HQ} / Hkv {HKV} / D {D} bf16 · cold L2, launch cost hidden")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(out_dir: str, sweep: bool, only: list[str]) -> None:
    torch.manual_seed(0)
    import triton

    kinds = only or ["decode", "extend", "cascade"]
    fi = load_flashinfer()
    res = {"gpu": torch.cuda.get_device_name(0), "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                        "flashinfer": getattr(fi, "__version__", None), "cuda": torch.version.cuda},
           "config": {"Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bf16", "flashinfer_page_size": PAGE, "only": kinds,
                      "timing": "median of 7 trials (3 in sweeps), each one CUDA-graph replay of 40 calls (10 for "
                                "extend; 20/5 in sweeps) between CUDA events, rotating buffer sets totalling >= 180 MB "
                                "(cold L2); *_eager_us: the same calls queued without a graph"}}
    t0 = time.time()
    res["ceilings"] = ceilings()
    log("ceilings", res["ceilings"])
    recs = correctness(tuple(kinds) + (() if only else ("other",)))
    res["correctness"] = [{"check": a, "rel_err": e, "bound": b, "ok": e <= b} for a, e, b in recs]
    bad = [r for r in res["correctness"] if not r["ok"]]
    log(f"correctness: {len(recs) - len(bad)}/{len(recs)} ok ({time.time() - t0:.0f} s)", *bad, sep="\n  ")
    bw, tf = res["ceilings"]["copy_TBps"] * 1e12, res["ceilings"]["bf16_matmul_TFLOPs"]
    benches = {"decode": lambda: bench_decode(fi, bw, sweep), "extend": lambda: bench_extend(fi, tf, bw, sweep),
               "cascade": lambda: bench_cascade(fi, bw, sweep)}
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
                res["ratios"][f"{kind} {r['shape']} ours/FI (run's default)"] = r["flashinfer_us"] / r["ours_us"]
                if "ours_current_default_us" in r:
                    res["ratios"][f"{kind} {r['shape']} ours/FI (current default)"] = (
                        r["flashinfer_us"] / r["ours_current_default_us"])
                if best is not None:
                    res["ratios"][f"{kind} {r['shape']} ours/FI (best swept)"] = r["flashinfer_us"] / best["us"]
            ours = r.get("ours_current_default_us", r["ours_us"])
            res["ratios"][f"{kind} {r['shape']} fraction of roofline"] = r["roofline_us"] / ours
    c = res.get("cascade", {})
    if "speedup_vs_plain" in c:
        res["ratios"]["cascade speedup vs plain decode (ours)"] = c["speedup_vs_plain"]
        res["ratios"]["cascade speedup vs plain decode's no-reuse roofline"] = c["roofline_plain_us"] / c["cascade_us"]
        if "flashinfer_plain_us" in c:
            res["ratios"]["cascade speedup vs plain decode (FlashInfer)"] = c["flashinfer_plain_us"] / c["cascade_us"]
        if "cascade_two_launch_us" in c:
            res["ratios"]["cascade speedup vs plain decode (two-launch impl)"] = c["plain_us"] / c["cascade_two_launch_us"]
        if "cascade_best_us" in c:
            res["ratios"]["cascade speedup vs plain decode (best swept)"] = c["plain_us"] / c["cascade_best_us"]
        res["ratios"]["cascade fraction of its roofline"] = c["roofline_cascade_us"] / c["cascade_us"]
    for k, v in res["ratios"].items():
        log(f"{k:55s} {v:6.2f}")
    log("graph capture failures:", res.get("graph_capture_failures", GRAPH_FAILURES))


def current_defaults(res: dict) -> None:
    """Attach, per shape, the sweep entry that matches the kernels' current default config
    (so defaults chosen from a run's sweep are reported with that run's numbers)."""
    for r in res.get("decode", []):
        want = {"block_n": 64, "num_warps": 4, "num_stages": 3, "splits": choose_num_splits(r["batch"], HKV, r["len"])}
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


def sm90_resources(cfg: dict, plan, bsz: int = 64, table_width: int = 8192 + 256 + PAGE) -> dict:
    """Compile the fused cascade kernel for sm_90 without a GPU (Triton's NVIDIA backend and its
    ptxas) with the launcher's specialisations at the benchmark shape (ints == 1 constant, ints
    and pointers divisible by 16 marked so): shared memory, registers, spill stack, CTAs per SM."""
    import os
    import re
    import subprocess

    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as tcompile

    lay = cas.fused_layout(bsz, HQ, HKV, plan, cfg, 132)
    fn = cas._cascade_fused_kernel
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "MidO": "*fp32", "MidLse": "*fp32"}
    ptr |= {n: "*i64" for n in ("ReqToToken", "ReqIdx", "SeqLens", "KvStart", "GroupPtr", "GroupShared", "SharedGroups")}
    ints = {"n_shared_tiles": lay.n_shared_tiles, "n_own_tiles": lay.n_own_tiles, "s_div": max(lay.s_sh, 1),
            "s_sh": lay.s_sh, "s_own": lay.s_own, "m_blocks": lay.m_blocks, "num_kv_heads": HKV, "num_q_heads": HQ,
            "split_stride": lay.s_sh + lay.s_own, "stride_qb": HQ * D, "stride_qh": D, "stride_kt": HKV * D,
            "stride_kh": D, "stride_vt": HKV * D, "stride_vh": D, "stride_rr": table_width}
    const = {"GROUP": HQ // HKV, "HEAD_DIM": D, "BLOCK_D": D, "BLOCK_M": cfg["block_m"], "BLOCK_N": cfg["block_n"],
             "BLOCK_H": 16, "OWN_BLOCK_N": cfg["own_block_n"] or cfg["block_n"],
             "SHARED_FIRST": bool(cfg["shared_first"]), "DOT_PREC": "tf32"}
    const |= {n: 1 for n, v in ints.items() if v == 1}
    sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    div16 = set(ptr) | {n for n, v in ints.items() if v % 16 == 0 and v != 1}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16})
    k = tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"],
                                                                 "num_stages": cfg["num_stages"]})
    path = f"/tmp/radixlm_cascade_{os.getpid()}.cubin"
    with open(path, "wb") as fh:
        fh.write(k.asm["cubin"])
    dump = subprocess.run([os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"), "-res-usage", path],
                          capture_output=True, text=True).stdout
    os.unlink(path)
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", dump).groups())
    smem = k.metadata.shared
    threads = 32 * cfg["num_warps"]
    ctas = min(65536 // (-(-regs // 8) * 8 * threads), 233472 // (smem + 1024), 2048 // threads)
    return {"smem": smem, "regs": regs, "spill_stack": stack, "ctas_per_sm": ctas,
            "cp_async": k.asm["ttgir"].count("async_copy_global_to_local")}


def dry_run() -> None:
    """CPU rehearsal of the cascade benchmark: the fused launch layouts the H200 sweep will use
    (132 SMs, the real shape) and each sweep tile compiled for sm_90 (resources), then every
    sweep tile run under TRITON_INTERPRET=1 at a tiny version of the shape (Hq 32 / Hkv 8 / D 128,
    4 requests sharing 128 tokens + a request sharing nothing) against the torch reference.
    Exits 1 if a compile or check fails."""
    import os
    import subprocess

    from radixlm.kernels._triton import interpreting

    seq = [8192 + 256] * 64
    plan = make_cascade_plan([64], [8192], seq, "cpu")
    if not interpreting():
        for bm in sorted({t[0] for t in CASCADE_TILES}):
            for w in CASCADE_WAVES:
                cfg = cas.resolve_config(block_m=bm, shared_waves=w)
                log(f"H200 layout block_m={bm} shared_waves={w}:", vars(cas.fused_layout(64, HQ, HKV, plan, cfg, 132)))
        failed = 0
        for bm, bn, nw, ns in CASCADE_TILES:
            cfg = cas.resolve_config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                log(f"sm_90 compile {(bm, bn, nw, ns)}:", sm90_resources(cfg, plan))
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                failed += 1
                log(f"sm_90 compile {(bm, bn, nw, ns)} FAILED: {type(exc).__name__}: {str(exc)[:800]}")
        rc = subprocess.run([sys.executable, __file__, "--dry-run"], env=dict(os.environ, TRITON_INTERPRET="1")
                            ).returncode
        sys.exit(rc or int(failed > 0))
    torch.manual_seed(0)
    variants = cascade_sweep_variants() + [{"impl": "fused", "shared_splits": 2, "own_splits": 3, "block_n": 32}]
    t0 = time.time()
    recs = checks.check_cascade("cpu", DT, [4, 1], [128, 0], [16, 16, 16, 16, 40], HQ, HKV, D, variants=variants)
    bad = [r for r in recs if not r[1] <= r[2]]
    for r in recs:
        log(f"{'ok ' if r[1] <= r[2] else 'BAD'} rel_err {r[1]:.2e} (bound {r[2]:.0e}) {r[0]}")
    log(f"dry run: {len(recs) - len(bad)}/{len(recs)} ok in {time.time() - t0:.0f} s")
    sys.exit(1 if bad else 0)


def parse_args(argv: list[str]):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default="benchmarks/results", help="where the JSON and PNG go")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile / split knobs (adds a few minutes)")
    ap.add_argument("--only", default="", help="comma list of decode,extend,cascade: run just those benchmarks "
                    "(and their correctness checks); writes kernels_h200_<only>.json so a full run is not overwritten")
    ap.add_argument("--reanalyze", nargs=4, metavar=("RUN_JSON", "OUT", "COPY_TBPS", "NOTE"),
                    help="re-derive rooflines/ratios of a saved run with a corrected copy bandwidth (CPU is fine)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: run the cascade sweep configs under "
                    "TRITON_INTERPRET=1 at a tiny version of the benchmark shape against the torch reference")
    args = ap.parse_args(argv)
    args.only = [k for k in args.only.split(",") if k]
    if set(args.only) - {"decode", "extend", "cascade"}:
        ap.error(f"--only: unknown {sorted(set(args.only) - {'decode', 'extend', 'cascade'})}")
    return args


if __name__ == "__main__":
    ARGS = parse_args(sys.argv[1:])
    if ARGS.reanalyze:
        run_json, out, tbps, note = ARGS.reanalyze
        reanalyze(run_json, out, float(tbps), note)
    elif ARGS.dry_run:
        dry_run()
    else:
        main(ARGS.out_dir, ARGS.sweep, ARGS.only)
