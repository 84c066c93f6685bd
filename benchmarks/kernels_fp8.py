"""FP8 (e4m3) KV decode attention benchmark, part of benchmarks/kernels.py (`--only fp8`): our
decode kernel reading an fp8 pool (unit scales, and per-head scales folded into q / the output)
beside our bf16 decode, FlashInfer's bf16 decode (the target: fp8 at B=64
L=4096 >= 1.8x faster than FlashInfer bf16) and, where it runs, FlashInfer's own fp8 decode. Same
timing as the other kernel benchmarks (CUDA-graph replays, cold L2, launch cost hidden)."""

from __future__ import annotations

import json
import traceback

import torch
from kernels_common import (
    DEV,
    DT,
    HKV,
    HQ,
    PAGE,
    D,
    fi_decode,
    fi_pages,
    fi_view,
    kv_sets,
    log,
    n_sets,
    paged_table,
    time_fn,
)

from radixlm.kernels.decode_attention import decode_attention
from radixlm.kernels.decode_splits import choose_decode_splits
from radixlm.kernels.kv_quant import FP8_KV_DTYPE, quantize_kv

FP8_DECODE = [(64, 4096), (128, 2048), (32, 16384)]
TARGET_VS_FLASHINFER_BF16 = 1.8
SWEEP = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 4, 2), (256, 8, 2), (64, 8, 3)]


def bench_fp8_decode(fi, bw: float, sweep: bool) -> list[dict]:
    return [fp8_decode_shape(fi, bw, sweep, bsz, L) for bsz, L in FP8_DECODE]


def _fi_fp8_decode(fi, table, seq, sets, qs) -> float:
    """FlashInfer's decode on fp8 pages (unit scales), or raises where this build has none."""
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    ptr, idx, last = fi_pages(table, seq)
    w.plan(ptr, idx, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=FP8_KV_DTYPE)
    fns = [lambda i=i: w.run(qs[i], (fi_view(sets[i][0]), fi_view(sets[i][1]))) for i in range(len(sets))]
    return time_fn(fns, label="flashinfer fp8 decode") * 1e6


def fp8_decode_shape(fi, bw: float, sweep: bool, bsz: int, L: int) -> dict:
    seq = [L] * bsz
    kv_bytes = 2 * bsz * L * HKV * D  # one byte per element
    table, n_slots = paged_table(seq)
    bf16_sets = kv_sets(n_slots, n_sets(kv_bytes * 2))
    ones = torch.ones(HKV, dtype=torch.float32, device=DEV)
    sets = [(quantize_kv(k, ones), quantize_kv(v, ones)) for k, v in bf16_sets]
    qs = [torch.randn(bsz, HQ, D, dtype=DT, device=DEV) for _ in bf16_sets]
    lens = torch.tensor(seq, device=DEV)
    ridx = torch.arange(bsz, device=DEV)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_decode_splits(bsz, HKV, L, sms, FP8_KV_DTYPE)
    bf16_splits = choose_decode_splits(bsz, HKV, L, sms, DT)
    ks = torch.linspace(0.5, 2.0, HKV, device=DEV)
    vs = torch.linspace(2.0, 0.5, HKV, device=DEV)

    def ours(i, kv, s=splits, **kw):
        return lambda: decode_attention(qs[i], kv[i][0], kv[i][1], table, ridx, lens, num_splits=s, **kw)

    n = len(sets)
    row: dict = {
        "shape": f"B={bsz} L={L}",
        "batch": bsz,
        "len": L,
        "kv_bytes_fp8": kv_bytes,
        "splits": splits,
        "roofline_fp8_us": (kv_bytes + 2 * bsz * HQ * D * 2) / bw * 1e6,
    }
    row["ours_fp8_us"] = time_fn([ours(i, sets) for i in range(n)], label="fp8 decode") * 1e6
    row["ours_fp8_scaled_us"] = (
        time_fn([ours(i, sets, k_scale=ks, v_scale=vs) for i in range(n)], label="fp8 decode scaled") * 1e6
    )
    row["ours_bf16_us"] = (
        time_fn([ours(i, bf16_sets, bf16_splits) for i in range(n)], label="bf16 decode") * 1e6
    )
    if sweep:
        row["sweep"] = _sweep(ours, sets, n, splits)
    if fi is not None:
        row["flashinfer_bf16_us"] = fi_decode(fi, table, seq, bf16_sets, qs)
        try:
            row["flashinfer_fp8_us"] = _fi_fp8_decode(fi, table, seq, sets, qs)
        except Exception:  # not every FlashInfer build decodes fp8 pages with tensor cores
            row["flashinfer_fp8_error"] = traceback.format_exc(limit=1)[-300:]
    row["ours_fp8_TBps"] = kv_bytes / row["ours_fp8_us"] / 1e6
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    return row


def _sweep(ours, sets, n: int, splits: int) -> list[dict]:
    out = []
    for bn, nw, ns in SWEEP:
        for s in sorted({max(1, splits // 2), splits, splits * 2}):
            cfg = {"block_n": bn, "num_warps": nw, "num_stages": ns, "splits": s}
            try:
                fns = [ours(i, sets, s, block_n=bn, num_warps=nw, num_stages=ns) for i in range(n)]
                out.append(cfg | {"us": time_fn(fns, 20, 3) * 1e6})
            except Exception as exc:  # a config that does not compile is recorded, not fatal
                out.append(cfg | {"error": str(exc)[:200]})
    log("  fp8 decode sweep best:", min((r for r in out if "us" in r), key=lambda r: r["us"], default=None))
    return out


def fp8_ratios(rows: list[dict]) -> dict[str, float]:
    """Speed-ups of our fp8-KV decode over FlashInfer bf16 (the acceptance line) and the rest."""
    out: dict[str, float] = {}
    for r in rows if isinstance(rows, list) else []:
        us = r["ours_fp8_us"]
        if "flashinfer_bf16_us" in r:
            out[f"fp8 decode {r['shape']} FI-bf16/ours-fp8 (target {TARGET_VS_FLASHINFER_BF16})"] = (
                r["flashinfer_bf16_us"] / us
            )
        if "flashinfer_fp8_us" in r:
            out[f"fp8 decode {r['shape']} FI-fp8/ours-fp8"] = r["flashinfer_fp8_us"] / us
        out[f"fp8 decode {r['shape']} ours-bf16/ours-fp8"] = r["ours_bf16_us"] / us
        out[f"fp8 decode {r['shape']} scaled/unit"] = r["ours_fp8_scaled_us"] / us
        out[f"fp8 decode {r['shape']} fraction of roofline"] = r["roofline_fp8_us"] / us
    return out
