"""The CPU's many-row path over GGUF blocks (prefill, decode batches above the kernel's row cap),
bf16 against fp32 dequantized weights, side by side in one process on the default model: rounds
alternate the dtype (radixlm.kernels.quant_gemv_cpu.dense_dtype swapped between them) and time
a long prompt's prefill and a batch of decodes; greedy tokens of both are compared.

    python benchmarks/cpu_dense_path.py [--rounds 3] [--prompt 800] [--batch 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_env import environment, write_result  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "cpu_dense_path.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _greedy(engine: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    engine.flush_cache()
    t = time.perf_counter()
    outs = engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    )
    return time.perf_counter() - t, [o["output_ids"] for o in outs]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=800, help="prefill length (tokens)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()

    from radixlm.backend.engine import Engine
    from radixlm.kernels import quant_gemv_cpu

    engine = Engine(device="cpu")
    tok = engine.tokenizer
    long = tok.encode("The history of the printing press begins in " * args.prompt)[: args.prompt]
    batch = [tok.encode(f"Question {i}: name a city and describe it.") for i in range(args.batch)]
    native = quant_gemv_cpu.dense_dtype()
    times: dict[str, dict[str, list[float]]] = {k: {"prefill_s": [], "batch_s": []} for k in DTYPES}
    outputs: dict[str, list[list[int]]] = {}
    try:
        _greedy(engine, batch[:2], 2)  # warm-up
        for _ in range(args.rounds):
            for name, dtype in DTYPES.items():
                quant_gemv_cpu.dense_dtype = lambda d=dtype: d  # type: ignore[assignment]
                times[name]["prefill_s"].append(_greedy(engine, [long], 1)[0])
                secs, outputs[name] = _greedy(engine, batch, args.tokens)
                times[name]["batch_s"].append(secs)
    finally:
        quant_gemv_cpu.dense_dtype = lambda: native  # type: ignore[assignment]
        engine.shutdown()
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in times.items()}
    same = sum(a == b for x, y in zip(outputs["bf16"], outputs["fp32"]) for a, b in zip(x, y))
    result = {
        "environment": environment(),
        "args": vars(args),
        "native_dense_dtype": str(native),
        "seconds": times,
        "median_s": med,
        "prefill_tok_s": {k: args.prompt / v["prefill_s"] for k, v in med.items()},
        "batch_out_tok_s": {k: args.batch * args.tokens / v["batch_s"] for k, v in med.items()},
        "fp32_speedup": {m: med["bf16"][m] / med["fp32"][m] for m in ("prefill_s", "batch_s")},
        "greedy_tokens_equal": f"{same} / {args.batch * args.tokens}",
    }
    print({k: result[k] for k in ("prefill_tok_s", "batch_out_tok_s", "fp32_speedup", "greedy_tokens_equal")})
    write_result(args.out, result)


if __name__ == "__main__":
    main()
