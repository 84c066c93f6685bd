"""Where a decode step's time goes on the GPU: runs one batch of decodes under torch.profiler and
prints the kernels by total device time, the device-busy time per step against the wall time
per step (their gap is host time the overlap scheduler failed to hide, or launch gaps inside
the CUDA graph), and writes the table as JSON. GPU only."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_env import environment
from suite_quant import one_row_kind

from radixlm.backend.engine import Engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-shape", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--quantization", default=None, help="weights quantized at load: q4_0, fp8, ...")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8_e4m3")
    p.add_argument(
        "--one-row-kind",
        default=None,
        help="one-row GGUF matmul kind for every weight instead of the default choice: int8x or dp4a",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with one_row_kind(args.one_row_kind):
        profile(args)


def profile(args: argparse.Namespace) -> None:
    eng = Engine(
        model_shape=args.model_shape,
        device="cuda",
        context_length=args.context_length,
        mem_fraction_static=0.6,
        overlap_schedule=not args.no_overlap,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    try:
        ids = [[100 + (i * 7 + j) % 20000 for j in range(args.input_len)] for i in range(args.batch)]
        sp = {"max_new_tokens": args.steps, "ignore_eos": True, "temperature": 0}
        eng.generate(input_ids=ids, sampling_params=sp)  # warm
        eng.flush_cache()
        eng.generate(input_ids=ids, sampling_params={**sp, "max_new_tokens": 1})  # prefill into the cache
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            eng.generate(input_ids=ids, sampling_params=sp)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rows = []
        for e in prof.key_averages():
            dev_us = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
            if dev_us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                rows.append({"name": e.key[:90], "calls": e.count, "device_us": dev_us})
        rows.sort(key=lambda r: -r["device_us"])
        busy = sum(r["device_us"] for r in rows) / 1e6
        res = {
            "benchmark": "profile_decode",
            "env": environment(),
            "args": vars(args),
            "wall_s": wall,
            "device_busy_s": busy,
            "steps": args.steps,
            "wall_ms_per_step": wall / args.steps * 1e3,
            "device_ms_per_step": busy / args.steps * 1e3,
            "kernels": rows[:40],
        }
        print(json.dumps({k: v for k, v in res.items() if k != "kernels"}, indent=1))
        for r in rows[:25]:
            print(
                f"{r['device_us'] / args.steps:9.1f} us/step  {r['calls'] / args.steps:6.1f}/step  {r['name']}"
            )
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
