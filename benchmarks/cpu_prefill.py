"""CPU prompt latency where new tokens extend a cached prefix: TorchAttentionBackend's split
(prefix and new tokens attended apart, merged by log-sum-exp) against one SDPA over a bottom-right
causal mask, side by side in one process on the default model. Rounds alternate the two
(prefix_split_min_tokens set or None on the running backend); greedy tokens of both are compared.

    python benchmarks/cpu_prefill.py [--rounds 3] [--threads 2]

Cases: fresh prompts longer than one prefill chunk (2,048 tokens on the CPU), whose later chunks
extend the earlier ones, and a conversation turn whose first part is already in the radix cache.
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

OUT = Path(__file__).resolve().parent / "results" / "cpu_prefill_prefix.json"
# (name, cached tokens, prompt tokens): the cached part is prefilled first, untimed
CASES = [
    ("fresh_3072", 0, 3072),
    ("fresh_4096", 0, 4096),
    ("turn_1024_plus_1024", 1024, 2048),
    ("turn_1024_plus_256", 1024, 1280),
]


def _run(engine: Any, prompt: list[int], cached: int, tokens: int) -> tuple[float, list[int]]:
    engine.flush_cache()
    greedy = {"temperature": 0, "ignore_eos": True}
    if cached:
        engine.generate(input_ids=[prompt[:cached]], sampling_params={**greedy, "max_new_tokens": 1})
    t = time.perf_counter()
    out = engine.generate(input_ids=[prompt], sampling_params={**greedy, "max_new_tokens": tokens})
    return time.perf_counter() - t, out[0]["output_ids"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from radixlm.backend.attention import PREFIX_SPLIT_MIN_TOKENS
    from radixlm.backend.engine import Engine

    engine = Engine(device="cpu")
    backend = engine.runner.attn_backend
    variants = {"masked": None, "split": PREFIX_SPLIT_MIN_TOKENS}
    text = "The history of the printing press begins in the workshops of the Rhine. " * 400
    ids = engine.tokenizer.encode(text)
    times: dict[str, dict[str, list[float]]] = {c[0]: {v: [] for v in variants} for c in CASES}
    outputs: dict[str, dict[str, list[int]]] = {c[0]: {} for c in CASES}
    try:
        _run(engine, ids[:64], 0, 2)  # warm-up
        for _ in range(args.rounds):
            for name, cached, n in CASES:
                for variant, least in variants.items():
                    backend.prefix_split_min_tokens = least
                    times[name][variant].append(_run(engine, ids[:n], cached, 1)[0])
        for name, cached, n in CASES:  # greedy continuations, untimed
            for variant, least in variants.items():
                backend.prefix_split_min_tokens = least
                outputs[name][variant] = _run(engine, ids[:n], cached, 8)[1]
    finally:
        backend.prefix_split_min_tokens = PREFIX_SPLIT_MIN_TOKENS
        engine.shutdown()
    rows = {}
    for name, cached, n in CASES:
        med = {v: statistics.median(ts) for v, ts in times[name].items()}
        rows[name] = {
            "cached_tokens": cached,
            "prompt_tokens": n,
            "masked_s": times[name]["masked"],
            "split_s": times[name]["split"],
            "speedup_median": med["masked"] / med["split"],
            "same_greedy_tokens": outputs[name]["masked"] == outputs[name]["split"],
        }
        print(f"{name:22s} masked {med['masked']:.3f} s  split {med['split']:.3f} s  "
              f"{rows[name]['speedup_median']:.2f}x  same tokens {rows[name]['same_greedy_tokens']}")  # fmt: skip
    write_result(
        args.out,
        {
            "env": environment(),
            "what": "CPU prompt latency (default model, generate max_new_tokens 1, greedy) for extends over a "
            "cached prefix: one SDPA over a bottom-right causal mask (masked) vs prefix and new tokens "
            f"attended apart and merged (split, from {PREFIX_SPLIT_MIN_TOKENS} new tokens), alternating",
            "threads": args.threads,
            "rounds": args.rounds,
            "cases": rows,
        },
    )


if __name__ == "__main__":
    main()
