"""Batch-1 decode with programmatic dependent launch (PDL) on for chosen kernels: one engine per
weight format (the 8B shape, random weights, CUDA graphs and overlap on), each PDL setting in
turn with the decode graphs captured again under it, rounds alternating the settings, timed as
the suite's decode_b1 times (overlap on and off, median of three). Says where PDL pays, kernel
by kernel. GPU only.

A setting is a RADIXLM_PDL value ("0", "1", "rmsnorm,rotary"), or "all-a,b" for every kernel but
a and b; then the kernels that release the next one right after their wait: the default's set
(no suffix), none (":exit": all release as their programs exit), or ":early=a,b"."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import suite_workloads as w
from bench_env import environment

from radixlm.backend.engine import Engine
from radixlm.kernels import _triton

DEFAULT_EARLY = _triton.PDL_EARLY  # before any setting replaces it


def parse_setting(setting: str) -> tuple[frozenset[str], frozenset[str]]:
    """(kernels PDL is on for, those that release the next kernel right after their wait)."""
    value, *suffixes = setting.split(":")
    early = DEFAULT_EARLY
    for suffix in suffixes:
        if suffix == "exit":
            early = frozenset()
        elif suffix.startswith("early="):
            early = _triton.pdl_kernels_from(suffix[6:])
        else:
            raise ValueError(f"setting {setting!r}: the suffixes are ':exit' and ':early=a,b'")
    if value.startswith("all-"):
        kernels = frozenset(_triton.PDL_KERNELS) - _triton.pdl_kernels_from(value[4:])
    else:
        kernels = _triton.pdl_kernels_from(value)
    return kernels, early


def apply_setting(engine: Engine, setting: str) -> None:
    """Switch PDL and capture the decode graphs again on the scheduler thread, between steps."""

    def recapture() -> None:
        _triton.PDL_ON, _triton.PDL_EARLY = parse_setting(setting)
        engine.runner.recapture_decode_graphs()
        if engine.runner.graph_runner is None:
            raise RuntimeError("decode graphs failed to capture")

    w.on_scheduler(engine, recapture)


def sweep(quantization: str | None, settings: list[str], rounds: int, model_shape: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = Engine(
        model_shape=model_shape,
        device="cuda",
        context_length=4096,
        quantization=quantization,
        cuda_graph_max_bs=8,  # batch-1 timing; keeps each capture short
    )
    res: dict[str, Any] = {"engine_start_s": time.perf_counter() - t0, "runs": {s: [] for s in settings}}
    try:
        for _ in range(rounds):
            for s in settings:
                apply_setting(engine, s)
                res["runs"][s].append(w.decode_b1(engine, in_len=512, out_len=256))
    finally:
        engine.shutdown()
    base = settings[0]
    res["summary"] = {}
    for s in settings:
        on = statistics.median(r["overlap_on"]["decode_tok_s"] for r in res["runs"][s])
        off = statistics.median(r["overlap_off"]["decode_tok_s"] for r in res["runs"][s])
        res["summary"][s] = {"overlap_on_tok_s": on, "overlap_off_tok_s": off}
    for s in settings:
        row = res["summary"][s]
        row["vs_first"] = row["overlap_on_tok_s"] / res["summary"][base]["overlap_on_tok_s"]
        row["vs_first_overlap_off"] = row["overlap_off_tok_s"] / res["summary"][base]["overlap_off_tok_s"]
        print(
            f"{quantization or 'bf16':6} {s:40} {row['overlap_on_tok_s']:7.1f} tok/s ({row['vs_first']:.3f}x)"
            f"  overlap off {row['overlap_off_tok_s']:7.1f} ({row['vs_first_overlap_off']:.3f}x)",
            flush=True,
        )
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", nargs="+", default=["q4_0"], help="weight formats; 'none' is bf16")
    p.add_argument("--settings", nargs="+", default=["0", "1"], help="the first is the baseline")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-shape", default="llama-3.1-8b")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    for s in args.settings:
        parse_setting(s)  # refuse a bad setting before any engine starts
    out: dict[str, Any] = {
        "benchmark": "pdl_sweep",
        "env": environment(),
        "settings": args.settings,
        "results": {},
    }
    for q in args.quantization:
        out["results"][q] = sweep(None if q == "none" else q, args.settings, args.rounds, args.model_shape)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
