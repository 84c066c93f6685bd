"""Cascade part of the H200 kernel benchmark (issue 7), run by benchmarks/kernels.py: 64 requests
sharing an 8192-token prefix + 256 own tokens each, fused impl vs two-launch impl vs plain decode,
the fused launch's parts timed alone, a tile / split sweep whose best is printed as a
FUSED_DEFAULTS line to paste; and the CPU rehearsal (--dry-run): layouts, sm_90 compiles, the
interpreter at a tiny shape, and the benchmark's Python run end to end with fake times."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable

import kernel_checks as checks
import torch
from kernels_common import DEV, DT, HKV, HQ, PAGE, D, fi_decode, kv_sets, log, n_sets, paged_table, time_fn

from radixlm.backend.cascade_groups import make_cascade_plan
from radixlm.kernels import cascade_attention as cas
from radixlm.kernels.cascade_attention import cascade_decode_attention
from radixlm.kernels.decode_attention import decode_attention
from radixlm.kernels.decode_splits import choose_num_splits

# Fused-cascade sweep: (block_m, block_n, num_warps, num_stages) tiles x shared_waves (shared-prefix
# programs per SM); the 2 best are then retried own-first and with other own_block_n.
CASCADE_TILES = [
    (64, 64, 4, 3),
    (64, 32, 4, 3),
    (64, 32, 4, 2),
    (64, 16, 4, 3),
    (64, 32, 8, 3),
    (64, 64, 8, 3),
    (128, 64, 8, 3),
    (128, 32, 8, 3),
]
CASCADE_WAVES = [0.5, 0.75, 1.0, 1.5, 2.0, 3.0]


def cascade_inputs(bsz: int, shared: int, own: int) -> dict:
    seq = [shared + own] * bsz
    table, n_slots = paged_table(seq, shared=shared)
    set_bytes = 2 * (shared + bsz * own) * HKV * D * 2
    sets = kv_sets(n_slots, n_sets(set_bytes))
    return {
        "seq": seq,
        "table": table,
        "set_bytes": set_bytes,
        "sets": sets,
        "qs": [torch.randn(bsz, HQ, D, dtype=DT, device=DEV) for _ in sets],
        "lens": torch.tensor(seq, device=DEV),
        "ridx": torch.arange(bsz, device=DEV),
        "plan": make_cascade_plan([bsz], [shared], seq, DEV),
    }


def bench_cascade(fi, bw: float, sweep: bool, bsz: int = 64, shared: int = 8192, own: int = 256) -> dict:
    x = cascade_inputs(bsz, shared, own)
    seq, table, sets, qs, lens, ridx, plan = (
        x[k] for k in ("seq", "table", "sets", "qs", "lens", "ridx", "plan")
    )
    n = len(sets)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plain0 = decode_attention(qs[0], *sets[0], table, ridx, lens, max_len=seq[0]).float()

    def casc(i, **kw):
        return lambda: cascade_decode_attention(qs[i], *sets[i], table, ridx, lens, plan, **kw)

    def err(**kw) -> float:
        return checks.rel_err(casc(0, **kw)(), plain0)

    splits = choose_num_splits(bsz, HKV, seq[0], sms)
    row = {
        "shape": f"{bsz} reqs, shared {shared} + own {own}",
        "cascade_vs_plain_rel_err": err(),
        "two_launch_vs_plain_rel_err": err(impl="two_launch"),
        "default_config": dict(cas.FUSED_DEFAULTS),
        "plain_us": time_fn(
            [
                lambda i=i: decode_attention(qs[i], *sets[i], table, ridx, lens, num_splits=splits)
                for i in range(n)
            ],
            label="plain decode",
        )
        * 1e6,
        "roofline_plain_us": 2 * bsz * seq[0] * HKV * D * 2 / bw * 1e6,
        "roofline_cascade_us": x["set_bytes"] / bw * 1e6,
        "shared_tflop": 4 * bsz * HQ * shared * D / 1e12,
    }
    row["cascade_us"] = time_fn([casc(i) for i in range(n)], label="cascade fused") * 1e6
    row["cascade_two_launch_us"] = (
        time_fn([casc(i, impl="two_launch") for i in range(n)], label="cascade two") * 1e6
    )
    row["cascade_unfused_merge_us"] = (
        time_fn([casc(i, impl="two_launch", fused_merge=False) for i in range(n)]) * 1e6
    )
    row["parts"] = cascade_parts(x, cas.resolve_config(), sms)
    row["shared_part_TFLOPs"] = row["shared_tflop"] / row["parts"]["shared_partial_us"] * 1e6
    row["own_part_TBps"] = 2 * bsz * own * HKV * D * 2 / row["parts"]["own_partial_us"] / 1e6
    log(json.dumps({k: v for k, v in row.items() if k != "sweep"}))
    if sweep:
        row["sweep"] = sweep_cascade(casc, err, n)
        good = [
            r
            for r in row["sweep"]
            if "us" in r and r["rel_err"] <= 1e-2 and r.get("impl") == "fused" and "own_splits" not in r
        ]
        diag = min(
            (r for r in row["sweep"] if "us" in r and "own_splits" in r), key=lambda r: r["us"], default=None
        )
        if diag is not None:
            log("  cascade best with explicit own_splits (diagnostic, not adoptable as is):", diag)
        best = min(good, key=lambda r: r["us"], default=None)
        if best is not None:
            cfg = {k: best[k] for k in cas.FUSED_DEFAULTS}
            row["best_config"], row["cascade_best_us"] = cfg, best["us"]
            row["parts_best"] = cascade_parts(x, cas.resolve_config(**cfg), sms)
            log(
                f"  cascade best swept {best['us']:.1f} us (default {row['cascade_us']:.1f} us); adopt in "
                f"kernels/cascade_attention.py:\n  FUSED_DEFAULTS: dict = {cfg!r}"
            )
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
    mids = [
        (torch.empty(q0.shape[0], HQ, s, D, device=DEV), torch.empty(q0.shape[0], HQ, s, device=DEV))
        for _ in x["sets"]
    ]
    outs = [torch.empty_like(q) for q in x["qs"]]

    def part(i, which):
        return lambda: cas.cascade_partial(
            x["qs"][i],
            *x["sets"][i],
            x["table"],
            x["ridx"],
            x["lens"],
            x["plan"],
            lay,
            *mids[i],
            1 / math.sqrt(D),
            cfg,
            which,
        )

    n = len(x["sets"])
    res = {"layout": vars(lay) | {"config": cfg}}
    for which in ("all", "shared", "own"):
        res[f"{which}_partial_us"] = (
            time_fn([part(i, which) for i in range(n)], label=f"cascade {which}") * 1e6
        )
    res["merge_us"] = (
        time_fn(
            [lambda i=i: cas.cascade_merge(*mids[i], x["plan"], lay.s_sh, outs[i]) for i in range(n)],
            label="cascade merge",
        )
        * 1e6
    )
    log("  cascade parts:", json.dumps(res))
    return res


def sweep_cascade(casc, err, n: int) -> list[dict]:
    """Tiles x shared_waves (shared_first, own_block_n = block_n); then the 2 best retried own-first,
    with other own_block_n and with 2 / 4 own splits; and the two-launch impl's best earlier config."""
    out: list[dict] = []

    def one(cfg: dict) -> None:
        try:
            t = time_fn([casc(i, **cfg) for i in range(n)], 20, 3)
            out.append(cfg | {"us": t * 1e6, "rel_err": err(**cfg)})
        except Exception as exc:  # a config that does not compile is recorded, not fatal
            out.append(cfg | {"error": str(exc)[:200]})

    for bm, bn, nw, ns in CASCADE_TILES:
        for w in CASCADE_WAVES:
            one(
                {
                    "impl": "fused",
                    "block_m": bm,
                    "block_n": bn,
                    "own_block_n": None,
                    "num_warps": nw,
                    "num_stages": ns,
                    "shared_waves": w,
                    "shared_first": True,
                }
            )
    top = sorted((r for r in out if "us" in r), key=lambda r: r["us"])[:2]
    for r in top:
        base = {k: r[k] for k in ("impl", *cas.FUSED_DEFAULTS)}
        one(base | {"shared_first": False})
        for obn in (32, 128):
            if obn != r["block_n"]:
                one(base | {"own_block_n": obn})
        for s_own in (2, 4):  # diagnostic only (no FUSED_DEFAULTS knob sets it): finer own-tail splits
            one(base | {"own_splits": s_own})
    for ss in (None, 16):
        one(
            {
                "impl": "two_launch",
                "block_m": 64,
                "block_n": 64,
                "num_warps": 4,
                "num_stages": 3,
                "shared_splits": ss,
            }
        )
    return out


def cascade_sweep_variants() -> list[dict]:
    """Every tile of the fused sweep (one shared_waves each), own-first, and the two-launch impl."""
    out = [
        {
            "impl": "fused",
            "block_m": bm,
            "block_n": bn,
            "num_warps": nw,
            "num_stages": ns,
            "shared_waves": CASCADE_WAVES[i % len(CASCADE_WAVES)],
        }
        for i, (bm, bn, nw, ns) in enumerate(CASCADE_TILES)
    ]
    return out + [
        {"impl": "fused", "shared_first": False, "own_block_n": 32},
        {"impl": "two_launch", "block_m": 64, "block_n": 64},
    ]


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
    ptr |= {
        n: "*i64"
        for n in ("ReqToToken", "ReqIdx", "SeqLens", "KvStart", "GroupPtr", "GroupShared", "SharedGroups")
    }
    ints = {
        "n_shared_tiles": lay.n_shared_tiles,
        "n_own_tiles": lay.n_own_tiles,
        "s_div": max(lay.s_sh, 1),
        "s_sh": lay.s_sh,
        "s_own": lay.s_own,
        "m_blocks": lay.m_blocks,
        "num_kv_heads": HKV,
        "num_q_heads": HQ,
        "split_stride": lay.s_sh + lay.s_own,
        "stride_qb": HQ * D,
        "stride_qh": D,
        "stride_kt": HKV * D,
        "stride_kh": D,
        "stride_vt": HKV * D,
        "stride_vh": D,
        "stride_rr": table_width,
    }
    const = {
        "GROUP": HQ // HKV,
        "HEAD_DIM": D,
        "BLOCK_D": D,
        "BLOCK_M": cfg["block_m"],
        "BLOCK_N": cfg["block_n"],
        "BLOCK_H": 16,
        "OWN_BLOCK_N": cfg["own_block_n"] or cfg["block_n"],
        "SHARED_FIRST": bool(cfg["shared_first"]),
        "DOT_PREC": "tf32",
    }
    const |= {n: 1 for n, v in ints.items() if v == 1}
    sig = {
        n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32")
        for n in fn.arg_names
    }
    div16 = set(ptr) | {n for n, v in ints.items() if v % 16 == 0 and v != 1}
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16},
    )
    k = tcompile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
    )
    path = f"/tmp/radixlm_cascade_{os.getpid()}.cubin"
    with open(path, "wb") as fh:
        fh.write(k.asm["cubin"])
    dump = subprocess.run(
        [os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"), "-res-usage", path],
        capture_output=True,
        text=True,
    ).stdout
    os.unlink(path)
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", dump).groups())
    smem = k.metadata.shared
    threads = 32 * cfg["num_warps"]
    ctas = min(65536 // (-(-regs // 8) * 8 * threads), 233472 // (smem + 1024), 2048 // threads)
    return {
        "smem": smem,
        "regs": regs,
        "spill_stack": stack,
        "ctas_per_sm": ctas,
        "cp_async": k.asm["ttgir"].count("async_copy_global_to_local"),
    }


def dry_run(script: str, summarize: Callable[[dict], None], plot: Callable[[dict, str], None]) -> None:
    """CPU rehearsal of the cascade benchmark: the fused launch layouts the H200 sweep will use
    (132 SMs, the real shape) and each sweep tile compiled for sm_90 (resources), then every
    sweep tile run under TRITON_INTERPRET=1 at a tiny version of the shape (Hq 32 / Hkv 8 / D 128,
    4 requests sharing 128 tokens + a request sharing nothing) against the torch reference.
    Exits 1 if a compile or check fails. script: benchmarks/kernels.py (re-run under the
    interpreter); summarize / plot: its report functions, rehearsed on the fake-time result."""
    import os
    import subprocess

    from radixlm.kernels._triton import interpreting

    seq = [8192 + 256] * 64
    plan = make_cascade_plan([64], [8192], seq, "cpu")
    if not interpreting():
        for bm in sorted({t[0] for t in CASCADE_TILES}):
            for w in CASCADE_WAVES:
                cfg = cas.resolve_config(block_m=bm, shared_waves=w)
                log(
                    f"H200 layout block_m={bm} shared_waves={w}:",
                    vars(cas.fused_layout(64, HQ, HKV, plan, cfg, 132)),
                )
        failed = 0
        for bm, bn, nw, ns in CASCADE_TILES:
            cfg = cas.resolve_config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                log(f"sm_90 compile {(bm, bn, nw, ns)}:", sm90_resources(cfg, plan))
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                failed += 1
                log(f"sm_90 compile {(bm, bn, nw, ns)} FAILED: {type(exc).__name__}: {str(exc)[:800]}")
        rc = subprocess.run(
            [sys.executable, script, "--dry-run"], env=dict(os.environ, TRITON_INTERPRET="1")
        ).returncode
        sys.exit(rc or int(failed > 0))
    torch.manual_seed(0)
    variants = cascade_sweep_variants() + [
        {"impl": "fused", "shared_splits": 2, "own_splits": 3, "block_n": 32}
    ]
    t0 = time.time()
    recs = checks.check_cascade(
        "cpu", DT, [4, 1], [128, 0], [16, 16, 16, 16, 40], HQ, HKV, D, variants=variants
    )
    bad = [r for r in recs if not r[1] <= r[2]]
    for r in recs:
        log(f"{'ok ' if r[1] <= r[2] else 'BAD'} rel_err {r[1]:.2e} (bound {r[2]:.0e}) {r[0]}")
    log(f"dry run: {len(recs) - len(bad)}/{len(recs)} ok in {time.time() - t0:.0f} s")
    rehearse_cascade_bench(summarize, plot)
    sys.exit(1 if bad else 0)


def rehearse_cascade_bench(summarize: Callable[[dict], None], plot: Callable[[dict, str], None]) -> None:
    """bench_cascade's Python end to end on the CPU (interpreter, 4 requests sharing 128 tokens,
    2 sweep tiles, every timed call run once and timed as 1 us), then summarize and plot: catches
    slips in the benchmark code before a device run. Its times mean nothing."""
    import tempfile
    from types import SimpleNamespace

    import kernels_common

    kernels_common.DEV, kernels_common.L2_BYTES = "cpu", 1
    globals().update(
        DEV="cpu",
        CASCADE_TILES=CASCADE_TILES[:2],
        CASCADE_WAVES=[1.0],
        time_fn=lambda fns, *a, **kw: [f() for f in fns] and 1e-6,
    )
    torch.cuda.get_device_properties = lambda *_: SimpleNamespace(multi_processor_count=4)  # type: ignore[assignment]
    res = {
        "gpu": "CPU rehearsal (fake times)",
        "cascade": bench_cascade(None, 4e12, True, bsz=4, shared=128, own=16),
    }
    summarize(res)
    with tempfile.TemporaryDirectory() as tmp:
        plot(res, f"{tmp}/rehearsal.png")
    log("benchmark rehearsal ok: keys", sorted(res["cascade"]))
