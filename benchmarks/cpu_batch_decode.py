"""CPU steps of more rows than one pass of the GGUF-block kernel takes, on the default model: decode
batches of B requests and one request's prompt of P tokens, each timed with the kernel run in
passes of GEMV_MAX_ROWS rows and with the whole weight dequantized once per call (the path past
GEMV_PASSES_MAX_ROWS), alternating in one process. Where the two meet is where
GEMV_PASSES_MAX_ROWS belongs.

    python benchmarks/cpu_batch_decode.py [--threads 2] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_env import environment, write_result  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402
from radixlm.kernels import quant_gemv_cpu  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "cpu_batch_decode.json"
BATCHES = (1, 8, 9, 16, 32, 64, 96, 128, 192)
PROMPTS = (16, 32, 64, 96, 128, 192, 256)
DECODE_TOKENS = 24


def decode_step_ms(engine: Engine, batch: int, rng: random.Random) -> float:
    """One decode step of `batch` requests (prompt and first token timed apart and dropped)."""
    prompts = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(batch)]

    def run(n: int) -> float:
        engine.flush_cache()
        t = time.perf_counter()
        params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - t

    short, long = run(2), run(2 + DECODE_TOKENS)
    return 1e3 * (long - short) / DECODE_TOKENS


def prefill_ms(engine: Engine, tokens: int, rng: random.Random) -> float:
    """One request's prompt of `tokens` tokens and its first output token."""
    ids = [rng.randrange(100, 40000) for _ in range(tokens)]
    engine.flush_cache()
    t = time.perf_counter()
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return 1e3 * (time.perf_counter() - t)


def timed_both(fn: Any, size: int, rounds: int) -> dict[str, Any]:
    """fn(size) with the kernel in passes and with dequantizing, alternating; medians in ms."""
    passes = quant_gemv_cpu.GEMV_PASSES_MAX_ROWS
    times: dict[str, list[float]] = {"passes": [], "dequantize": []}
    fn(size)  # warm-up
    for _ in range(rounds):
        for mode in times:
            quant_gemv_cpu.GEMV_PASSES_MAX_ROWS = (
                1 << 30 if mode == "passes" else quant_gemv_cpu.GEMV_MAX_ROWS
            )
            try:
                times[mode].append(fn(size))
            finally:
                quant_gemv_cpu.GEMV_PASSES_MAX_ROWS = passes
    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    return {
        "size": size,
        "ms": med,
        "each_ms": times,
        "passes_vs_dequantize": med["dequantize"] / med["passes"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(max_total_tokens=16384)
    rng = random.Random(0)
    try:
        decode = [timed_both(lambda b: decode_step_ms(engine, b, rng), b, args.rounds) for b in BATCHES]
        prefill = [timed_both(lambda n: prefill_ms(engine, n, rng), n, args.rounds) for n in PROMPTS]
    finally:
        engine.shutdown()
    for name, rows in (("decode step, batch", decode), ("prompt, tokens", prefill)):
        for r in rows:
            ms = r["ms"]
            print(
                f"{name} {r['size']:4d}: passes {ms['passes']:7.1f} ms  dequantize {ms['dequantize']:7.1f} ms  "
                f"x{r['passes_vs_dequantize']:.2f}"
            )
    write_result(
        args.out,
        {
            "env": environment(),
            "threads": args.threads,
            "rounds": args.rounds,
            "gemv_max_rows": quant_gemv_cpu.GEMV_MAX_ROWS,
            "gemv_passes_max_rows": quant_gemv_cpu.GEMV_PASSES_MAX_ROWS,
            "decode_step": decode,
            "prompt": prefill,
        },
    )


if __name__ == "__main__":
    main()
