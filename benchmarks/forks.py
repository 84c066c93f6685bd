"""Fork-heavy program workload (issue 7): one radixlm program reads a long shared document, forks
into N branches (each adds its own short question) and every branch generates M tokens (greedy,
ignore_eos). Run with cascade attention on, off, and on again, on the same engine in the same
process; reports decode tok/s per mode, the speedup, the engine's cascade step counts, and how
many branches' greedy outputs match between on and off (reported, not asserted: random weights
give near-flat logits, where bf16 rounding differences can flip a token).

Decode time = (program with M tokens) - (the same program with 1 token), radix cache flushed
before each, so the shared prefill and the branches' prefills cancel out.

CPU:  python benchmarks/forks.py --shared-len 256 --forks 4 --output-len 8
H200: python benchmarks/forks.py --model-shape llama-3.1-8b --device cuda
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_env import device_tag, environment, write_result  # noqa: E402

import radixlm as sgl  # noqa: E402
from radixlm.backend.engine import Engine  # noqa: E402
from radixlm.runtime import Runtime  # noqa: E402

WORDS = (
    "river stone market letter engine garden window silver morning harbor lantern copper "
    "meadow signal thunder candle orchard bridge compass velvet granite falcon pepper "
    "quarry ribbon saddle timber violet walnut anchor basket cinder dagger ember"
).split()


@sgl.function
def fork_questions(s, document: str, forks: int, output_len: int):
    s += document
    branches = s.fork(forks)
    branches += [f"\nQuestion {i}: what does section {i} of the notes say?\nAnswer:" for i in range(forks)]
    branches += sgl.gen("answer", max_tokens=output_len, ignore_eos=True)
    branches.join()


class RecordingRuntime(Runtime):
    """Keeps every generation's output ids by its prompt (each branch's prompt is distinct)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine=engine)
        self.outputs: dict[tuple[int, ...], list[int]] = {}
        self._lock = threading.Lock()

    def _request(self, input_ids, sampling, **logprob):
        outs = Runtime._request(self, input_ids, sampling, **logprob)
        with self._lock:
            for ids, out in zip(input_ids, outs):
                self.outputs[tuple(ids)] = list(out.get("output_ids", []))
        return outs


def synthetic_document(tokenizer: Any, n_tokens: int, seed: int) -> tuple[str, int]:
    """Few-shot-like notes of about n_tokens tokens (cut at a line end); returns (text, tokens)."""
    rng = random.Random(seed)
    lines: list[str] = []
    count = 0
    while count < n_tokens:
        batch = [
            f"Note {len(lines) + k}: the {rng.choice(WORDS)} near the {rng.choice(WORDS)} is "
            f"{' '.join(rng.choices(WORDS, k=8))}.\n"
            for k in range(64)
        ]
        lines += batch
        count = len(tokenizer.encode("".join(lines)))
    lo, hi = 0, len(lines)  # the longest prefix of lines within n_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode("".join(lines[:mid]))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = "".join(lines[:lo])
    return text, len(tokenizer.encode(text))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_run(
    runtime: RecordingRuntime, document: str, forks: int, output_len: int
) -> tuple[float, dict[str, int]]:
    """One program run from a flushed cache: (wall seconds, the engine counters it moved)."""
    engine = runtime.engine
    if not engine.flush_cache():
        raise RuntimeError("could not flush the radix cache (requests still running?)")
    before = engine.get_stats()
    sync(engine.device)
    t0 = time.perf_counter()
    fork_questions.run(document, forks, output_len, temperature=0, backend=runtime)
    sync(engine.device)
    dt = time.perf_counter() - t0
    after = engine.get_stats()
    keys = (
        "forward_passes",
        "generated_tokens",
        "cascade_steps",
        "computed_prompt_tokens",
        "cached_prompt_tokens",
    )
    return dt, {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def run_mode(
    runtime: RecordingRuntime, cascade: bool, document: str, args: argparse.Namespace
) -> dict[str, Any]:
    runtime.engine.scheduler.cfg.enable_cascade = cascade  # read every step; the loop is idle here
    runtime.outputs = {}
    full_s, counters = timed_run(runtime, document, args.forks, args.output_len)
    outputs = dict(runtime.outputs)
    one_s, _ = timed_run(runtime, document, args.forks, 1)
    decode_tokens = args.forks * (args.output_len - 1)
    decode_s = full_s - one_s
    res = {
        "cascade": cascade,
        "program_s": full_s,
        "program_1_token_s": one_s,
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
        "output_tok_s": args.forks * args.output_len / full_s,
        **counters,
    }
    print(
        f"cascade {'on ' if cascade else 'off'}: program {full_s:.2f} s, decode {decode_s:.2f} s, "
        f"{res['decode_tok_s'] or float('nan'):.1f} decode tok/s, cascade steps {counters['cascade_steps']} "
        f"of {counters['forward_passes']} forward passes"
    )
    return {"result": res, "outputs": outputs}


def match_fraction(
    a: dict[tuple[int, ...], list[int]], b: dict[tuple[int, ...], list[int]]
) -> dict[str, Any]:
    keys = sorted(set(a) & set(b))
    same = sum(a[k] == b[k] for k in keys)
    return {
        "branches": len(keys),
        "identical": same,
        "fraction": same / len(keys) if keys else None,
        "missing": len(set(a) ^ set(b)),
    }


def _note(result: dict[str, Any]) -> str:
    """Say what the on/off ratio means for this run."""
    steps = [r["cascade_steps"] for r in result["runs"] if r["cascade"]]
    if not all(steps):
        why = (
            "this attention backend ignores cascade plans"
            if not result["backend_runs_cascade_plans"]
            else "find_cascade_groups judged the sharing too small to pay"
        )
        return (
            f"cascade steps in the 'on' runs: {steps} -- on and off ran the same attention ({why}); "
            "their ratio is run-to-run noise, not a cascade effect"
        )
    return f"cascade steps in the 'on' runs: {steps}; the ratio compares cascade with plain paged decode"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument(
        "--model-shape", default=None, help="named real shape with random weights, e.g. llama-3.1-8b"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--shared-len", type=int, default=None, help="shared document tokens (default 8192 GPU, 256 CPU)"
    )
    p.add_argument("--forks", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.forks < 2 or args.output_len < 2:
        p.error(
            "--forks and --output-len must be at least 2 (decode time is the M-token run minus the 1-token run)"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t_load = time.perf_counter()
    engine = Engine(
        model_path=args.model_path,
        model_shape=args.model_shape,
        device=args.device,
        dtype=args.dtype,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=max(256, args.forks + 8),
    )
    load_s = time.perf_counter() - t_load
    if args.shared_len is None:
        args.shared_len = 8192 if engine.device.type == "cuda" else 256
    result: dict[str, Any] = {
        "benchmark": "forks",
        "env": environment(),
        "args": vars(args),
        "model": engine.model_config.model_name,
        "engine_load_s": load_s,
        "attention_backend": type(engine.runner.attn_backend).__name__,
        "backend_runs_cascade_plans": engine.runner.supports_cascade,
        "cascade_enabled_by_default": engine.scheduler.cfg.enable_cascade,
    }
    try:
        runtime = RecordingRuntime(engine)
        document, n_doc = synthetic_document(engine.tokenizer, args.shared_len, args.seed)
        result["shared_tokens"] = n_doc
        for cascade in (True, False):  # warm-up: kernels of both paths compile outside the timed runs
            engine.scheduler.cfg.enable_cascade = cascade
            timed_run(runtime, document, min(args.forks, 4), 3)
        runs = [run_mode(runtime, c, document, args) for c in (True, False, True)]
        result["runs"] = [r["result"] for r in runs]
        on = [r["result"]["decode_tok_s"] for r in runs if r["result"]["cascade"]]
        off = runs[1]["result"]["decode_tok_s"]
        if off and all(on):
            result["decode_speedup_on_vs_off"] = [x / off for x in on]
            print("decode speedup cascade on / off: " + ", ".join(f"{x / off:.2f}x" for x in on))
        result["note"] = _note(result)
        print(result["note"])
        result["greedy_match_on_vs_off"] = match_fraction(runs[0]["outputs"], runs[1]["outputs"])
        result["greedy_match_on_vs_on"] = match_fraction(runs[0]["outputs"], runs[2]["outputs"])
        print(f"greedy outputs identical on vs off: {result['greedy_match_on_vs_off']}")
    finally:
        engine.shutdown()
    dev = "cpu" if engine.device.type == "cpu" else device_tag(result["env"])
    write_result(args.out or Path(__file__).parent / "results" / f"forks_{dev}.json", result)
    return result


if __name__ == "__main__":
    main()
