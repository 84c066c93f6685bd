"""Prefix-sharing benchmark (issue 3): the radix cache on vs off in the same run, output tok/s
and prompt-cache hit rate for three workloads — (a) few-shot: many questions behind one long
prefix; (b) tree: roots, then branches continuing each root's generation; (c) multi-turn chat
sessions whose every turn re-sends the whole history. Prompts are random token ids
(ignore_eos, fixed output lengths), so both runs do the same amount of work.

CPU (default model):  python benchmarks/prefix_sharing.py --small
H200 (random 8B):     python benchmarks/prefix_sharing.py --random-weights --model-shape llama-3.1-8b \
                          --device cuda   # → benchmarks/results/prefix_sharing_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_env import environment, write_result  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402

FULL = {
    "few_shot": {"prefix_len": 2048, "num_questions": 256, "question_len": 48, "output_len": 32},
    "tree": {
        "num_roots": 32,
        "branches": 8,
        "root_len": 512,
        "root_output_len": 128,
        "branch_len": 32,
        "branch_output_len": 64,
    },
    "multi_turn": {"num_sessions": 64, "turns": 4, "system_len": 512, "user_len": 64, "output_len": 64},
}
SMALL = {
    "few_shot": {"prefix_len": 512, "num_questions": 24, "question_len": 16, "output_len": 8},
    "tree": {
        "num_roots": 4,
        "branches": 4,
        "root_len": 128,
        "root_output_len": 16,
        "branch_len": 8,
        "branch_output_len": 8,
    },
    "multi_turn": {"num_sessions": 8, "turns": 4, "system_len": 128, "user_len": 16, "output_len": 8},
}


class Runner:
    """Submits batches to one engine, timing them and summing what its results report."""

    def __init__(self, engine: Engine, vocab: int, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.hi = min(vocab, 32000)
        self.elapsed = 0.0
        self.outputs: list[list[int]] = []
        self.prompt_tokens = self.cached_tokens = self.output_tokens = 0

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.hi) for _ in range(n)]

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        sync(self.engine.device)
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        sync(self.engine.device)
        self.elapsed += time.perf_counter() - t0
        for o in outs:
            m = o["meta_info"]
            self.prompt_tokens += m["prompt_tokens"]
            self.cached_tokens += m["cached_tokens"]
            self.output_tokens += m["completion_tokens"]
        got = [o["output_ids"] for o in outs]
        self.outputs += got
        return got


def few_shot(r: Runner, prefix_len: int, num_questions: int, question_len: int, output_len: int) -> None:
    prefix = r.ids(prefix_len)
    r.generate([prefix + r.ids(question_len) for _ in range(num_questions)], output_len)


def tree(
    r: Runner,
    num_roots: int,
    branches: int,
    root_len: int,
    root_output_len: int,
    branch_len: int,
    branch_output_len: int,
) -> None:
    roots = [r.ids(root_len) for _ in range(num_roots)]
    conts = r.generate(roots, root_output_len)
    kids = [root + cont + r.ids(branch_len) for root, cont in zip(roots, conts) for _ in range(branches)]
    r.generate(kids, branch_output_len)


def multi_turn(
    r: Runner, num_sessions: int, turns: int, system_len: int, user_len: int, output_len: int
) -> None:
    history = [r.ids(system_len) for _ in range(num_sessions)]
    for _ in range(turns):
        prompts = [h + r.ids(user_len) for h in history]
        outs = r.generate(prompts, output_len)
        history = [p + o for p, o in zip(prompts, outs)]


WORKLOADS: dict[str, Callable[..., None]] = {"few_shot": few_shot, "tree": tree, "multi_turn": multi_turn}


def sync(device: Any) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(args: argparse.Namespace, disable: bool) -> Engine:
    return Engine(
        model_path=args.model_path,
        device=args.device,
        dtype=args.dtype,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        disable_radix_cache=disable,
        random_weights=args.random_weights,
        model_shape=args.model_shape,
        seed=args.seed,
    )


def run_mode(args: argparse.Namespace, sizes: dict[str, dict], disable: bool) -> dict[str, Any]:
    """All workloads on one engine (radix cache on or off); runs in its own process."""
    engine = make_engine(args, disable)
    try:
        vocab = engine.model_config.vocab_size
        warm = Runner(engine, vocab, seed=999)  # compile kernels for long and short extends, decode
        warm.generate(
            [warm.ids(min(args.chunked_prefill_size, 1024) + 64)] + [warm.ids(32) for _ in range(8)], 4
        )
        results: dict[str, Any] = {"device": str(engine.device)}
        for name in args.workloads:
            engine.flush_cache()
            before = engine.get_stats()
            deferred = engine.scheduler.policy.num_deferred
            r = Runner(engine, vocab, seed=args.seed)
            WORKLOADS[name](r, **sizes[name])
            results[name] = summarize(r, before, engine.get_stats())
            results[name]["requests_deferred_by_dedup"] = engine.scheduler.policy.num_deferred - deferred
            print(
                f"  radix {'off' if disable else 'on '} {name:10s} {results[name]['output_throughput']:9.1f} "
                f"out tok/s  hit {results[name]['hit_rate']:.3f}  {r.elapsed:.2f} s",
                flush=True,
            )
            results[name]["_outputs"] = r.outputs
        return results
    finally:
        engine.shutdown()


def run_mode_subprocess(mode: str) -> dict[str, Any]:
    """A fresh process per mode: each engine gets the whole GPU, and nothing carries over."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--mode", mode, "--partial-out", path], check=True
        )
        return json.loads(Path(path).read_text())
    finally:
        os.unlink(path)


def summarize(r: Runner, before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    delta = {
        k: after[k] - before[k]
        for k in (
            "cached_prompt_tokens",
            "computed_prompt_tokens",
            "forward_passes",
            "num_retractions",
            "generated_tokens",
        )
    }
    return {
        "duration_s": r.elapsed,
        "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_throughput": r.output_tokens / r.elapsed,
        "total_throughput": (r.output_tokens + r.prompt_tokens) / r.elapsed,
        "hit_rate": r.cached_tokens / max(r.prompt_tokens, 1),
        "engine_stats_delta": delta,
    }


def compare(
    on: dict[str, Any], off: dict[str, Any], names: list[str], sizes: dict[str, dict]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        a, b = on[name], off[name]
        outs_on, outs_off = a.pop("_outputs"), b.pop("_outputs")
        same = sum(x == y for x, y in zip(outs_on, outs_off))
        out[name] = {
            "sizes": sizes[name],
            "radix_on": a,
            "radix_off": b,
            "speedup_output_throughput": a["output_throughput"] / b["output_throughput"],
            # Informational: bf16 on GPU may flip near-ties between batch shapes.
            "greedy_outputs_identical": f"{same}/{len(outs_on)}",
        }
    return out


def default_out(device: str) -> str:
    if not device.startswith("cuda"):
        return "benchmarks/results/prefix_sharing_cpu.json"
    gpu = torch.cuda.get_device_name().lower()
    tag = "h200" if "h200" in gpu else gpu.replace(" ", "_")
    return f"benchmarks/results/prefix_sharing_{tag}.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU-sized workloads")
    p.add_argument("--workloads", default="few_shot,tree,multi_turn")
    p.add_argument("--sizes", default="{}", help='overrides, e.g. \'{"few_shot": {"num_questions": 64}}\'')
    p.add_argument("--model-path", default=None)
    p.add_argument("--model-shape", default=None)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--mode", choices=["both", "on", "off"], default="both", help=argparse.SUPPRESS)
    p.add_argument("--partial-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workloads {bad}; choose from {sorted(WORKLOADS)}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main() -> None:
    args = parse_args()
    sizes = {k: dict(v) for k, v in (SMALL if args.small else FULL).items()}
    for name, over in json.loads(args.sizes).items():
        unknown = set(over) - set(sizes.get(name, {}))
        if name not in sizes or unknown:
            raise ValueError(f"--sizes: unknown workload {name!r} or keys {sorted(unknown)}")
        sizes[name].update(over)
    if args.mode != "both":
        part = run_mode(args, sizes, disable=args.mode == "off")
        Path(args.partial_out).write_text(json.dumps(part))
        return
    print(f"prefix sharing: {args.workloads} on {args.device} ({'small' if args.small else 'full'} sizes)")
    off = run_mode_subprocess("off")
    on = run_mode_subprocess("on")
    result = {
        "benchmark": "prefix_sharing",
        "env": environment(),
        "args": {k: v for k, v in vars(args).items() if k not in ("mode", "partial_out")},
        "model": args.model_path
        or (args.model_shape and f"random:{args.model_shape}")
        or "default (SmolLM2-135M GGUF)",
        "workloads": compare(on, off, args.workloads, sizes),
    }
    for name, w in result["workloads"].items():
        print(
            f"{name:10s} speedup {w['speedup_output_throughput']:.2f}x  hit rate on "
            f"{w['radix_on']['hit_rate']:.3f}  identical outputs {w['greedy_outputs_identical']}"
        )
    write_result(args.out or default_out(args.device), result)


if __name__ == "__main__":
    main()
