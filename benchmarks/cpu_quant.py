"""CPU decode with GGUF weights kept quantized, beside llama.cpp on the same file. One run measures,
side by side and interleaved round by round, batch-1 decode tokens/s of radixlm (GGUF blocks
kept; and dequantized to fp32) and of llama-cpp-python with the same thread count; each
measurement runs in its own process (no two thread pools spinning at once). --kernels times the
candidate CPU matmul paths per layer shape, with their error against gguf's dequantization;
--quality adds load time, greedy agreement and perplexity (benchmarks/cpu_quant_quality.py).

    python benchmarks/cpu_quant.py [--threads 2] [--rounds 3] [--tokens 128] [--kernels] [--quality]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_env import environment, write_result  # noqa: E402

PROMPT = "The history of the printing press begins"
SYSTEMS = ("radixlm-gguf", "llama.cpp", "radixlm-fp32")
OUT = Path(__file__).resolve().parent / "results" / "cpu_quant.json"


def _model_path() -> str:
    from radixlm.backend.loader import default_model_path

    return default_model_path()


def decode_radixlm(quantization: str, tokens: int, threads: int) -> dict[str, Any]:
    """Decode tokens/s from two lengths (the difference drops prefill and the first token)."""
    import torch

    torch.set_num_threads(threads)
    from radixlm.backend.engine import Engine

    t0 = time.perf_counter()
    eng = Engine(quantization=quantization, max_total_tokens=4096)
    load_s = time.perf_counter() - t0
    try:
        ids = eng.tokenizer.encode(PROMPT)

        def timed(n: int) -> float:
            eng.flush_cache()
            t = time.perf_counter()
            eng.generate(
                input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
            )
            return time.perf_counter() - t

        timed(8)  # warm-up
        short, long = timed(8), timed(8 + tokens)
    finally:
        eng.shutdown()
    return {"tok_s": tokens / (long - short), "load_s": load_s}


def decode_llama_cpp(model: str, tokens: int, threads: int) -> dict[str, Any]:
    """The same measurement through llama.cpp's own decode loop: eval one token, argmax, repeat.
    The prompt is fed one token at a time too: this build's batched prompt eval (AMX int8 path)
    segfaults on this machine. The process never imports torch (two OpenMP runtimes)."""
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode(), add_bos=False)

    def timed(n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        for tok in ids:
            llm.eval([tok])
        for _ in range(n - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return time.perf_counter() - t

    timed(8)
    short, long = timed(8), timed(8 + tokens)
    return {"tok_s": tokens / (long - short), "load_s": load_s}


def worker(system: str, model: str, tokens: int, threads: int) -> dict[str, Any]:
    if system == "llama.cpp":
        return decode_llama_cpp(model, tokens, threads)
    return decode_radixlm("gguf" if system == "radixlm-gguf" else "dequantize", tokens, threads)


def run_worker(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": args[args.index("--threads") + 1]}
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def side_by_side(model: str, rounds: int, tokens: int, threads: int) -> dict[str, Any]:
    per: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    loads = []
    for r in range(rounds):
        for system in SYSTEMS:
            loads.append(os.getloadavg()[0])
            args = ["--worker", system, "--model", model, "--tokens", str(tokens), "--threads", str(threads)]
            res = run_worker(args)
            per[system].append(res)
            print(
                f"round {r + 1} {system:13s} {res['tok_s']:7.1f} tok/s (load {res['load_s']:.2f} s)",
                flush=True,
            )
    out: dict[str, Any] = {
        "threads": threads,
        "decode_tokens": tokens,
        "rounds": rounds,
        "load_average_1min_before_each": loads,
    }
    for system, rs in per.items():
        tok = [x["tok_s"] for x in rs]
        out[system] = {
            "tok_s_median": statistics.median(tok),
            "tok_s_each": tok,
            "spread_pct": 100 * (max(tok) - min(tok)) / statistics.median(tok),
            "load_s_each": [x["load_s"] for x in rs],
        }
    anchor = out["llama.cpp"]["tok_s_median"]
    out["ratio_gguf_vs_llama_cpp"] = out["radixlm-gguf"]["tok_s_median"] / anchor
    out["ratio_fp32_vs_llama_cpp"] = out["radixlm-fp32"]["tok_s_median"] / anchor
    # the ratio within each round (the three ran back to back), less exposed to load drifting
    out["ratio_gguf_vs_llama_cpp_each_round"] = [
        g["tok_s"] / a["tok_s"] for g, a in zip(per["radixlm-gguf"], per["llama.cpp"])
    ]
    return out


def noise_note(decode: dict[str, Any], cpus: int) -> str:
    """What the spread says: on a shared machine the rounds disagree, llama.cpp's most (its
    threads meet at a spin barrier after every op, which a busy core stalls)."""
    busiest = max(decode["load_average_1min_before_each"])
    spreads = ", ".join(f"{s} {decode[s]['spread_pct']:.0f}%" for s in SYSTEMS)
    shared = "shared" if busiest > cpus else "quiet"
    return f"{shared} machine: 1-min load average up to {busiest:.1f} on {cpus} cores; spread over rounds: {spreads}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--kernels", action="store_true", help="also time the CPU matmul candidates")
    p.add_argument("--quality", action="store_true", help="also load time, greedy agreement, perplexity")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=(*SYSTEMS, "kernels", "quality"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "kernels":
        from cpu_quant_kernels import time_candidates

        print(json.dumps(time_candidates(args.threads)))
        return
    if args.worker == "quality":
        from cpu_quant_quality import quality

        print(json.dumps(quality(args.threads)))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.tokens, args.threads)))
        return
    env = environment()
    try:
        import importlib.metadata as md

        env["llama_cpp_python"] = md.version("llama-cpp-python")
        env["gguf"] = md.version("gguf")
    except Exception:  # noqa: BLE001 - recorded as missing
        pass
    model = _model_path()
    env["model"] = Path(model).name
    result: dict[str, Any] = {
        "env": env,
        "decode": side_by_side(model, args.rounds, args.tokens, args.threads),
    }
    if args.kernels:
        result["kernels"] = run_worker(["--worker", "kernels", "--threads", str(args.threads)])
    if args.quality:
        result["quality"] = run_worker(["--worker", "quality", "--threads", str(args.threads)])
    result["load_average_1_5_15_after"] = os.getloadavg()
    result["noise_note"] = noise_note(result["decode"], os.cpu_count() or 1)
    write_result(args.out, result)
    d = result["decode"]
    print(
        f"radixlm GGUF {d['radixlm-gguf']['tok_s_median']:.1f} tok/s, fp32 {d['radixlm-fp32']['tok_s_median']:.1f},"
        f" llama.cpp {d['llama.cpp']['tok_s_median']:.1f}: {d['ratio_gguf_vs_llama_cpp']:.2f}x llama.cpp"
    )


if __name__ == "__main__":
    main()
