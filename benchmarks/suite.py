"""The end-to-end suite: every workload on the engine's DEFAULT settings, each speed feature on
and off in the same run, first runs included, as ratios (see suite_report.py for the list and
their targets). Workers run one after another in fresh processes (each gets the whole device):
the default engine, a radix-off engine, the HF transformers anchor, the HTTP server, and engines
with quantized weights or an fp8 KV cache (suite_quant.py).

    python benchmarks/suite.py --device cuda                  # H200: Llama-3.1-8B shape, random bf16
    python benchmarks/suite.py --small --device cpu           # default model, a few minutes
    python benchmarks/suite.py --device cuda --compare benchmarks/results/suite_h200.json
    python benchmarks/suite.py --readme benchmarks/results/suite_h200.json   # README's Measured section

Writes benchmarks/results/suite_<device>.json, .md and (with matplotlib) .png; --compare exits 1
when any ratio fell by more than 5% against the given result."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import prefix_sharing  # noqa: E402
import suite_report  # noqa: E402
from bench_env import device_tag, environment, write_result  # noqa: E402

RESULTS = Path(__file__).parent / "results"

FULL: dict[str, Any] = {
    "engine": {"model_shape": "llama-3.1-8b", "context_length": 16384},
    "decode_b1": {"in_len": 512, "out_len": 256},
    "b128": {"n": 128, "in_len": 512, "out_len": 256, "ratio": 1.0},
    "mixed": {"n": 1000, "in_len": 1024, "out_len": 512, "ratio": 0.25},
    "prefix": prefix_sharing.FULL,
    "forks": {"shared_len": 8192, "forks": 64, "output_len": 128},
    "json": {"batch": 64, "max_new_tokens": 384},
    "serving": {"num_requests": 300, "input_len": 512, "output_len": 256, "ratio": 0.5, "rates": ["inf", 16]},
    "programs": {"batch": 16, "kinds": ["few_shot_qa", "tree_of_thought", "json_extraction"], "repeats": 3},
    "speculative": {"b1_new": 128, "batch": 64, "batch_new": 64, "reps": 2},
    "timeouts": {"engine": 300, "radix_off": 90, "hf": 70, "server": 110, "quant": 300},
}
SMALL: dict[str, Any] = {
    "engine": {},
    "decode_b1": {"in_len": 32, "out_len": 12},
    "b128": {"n": 6, "in_len": 32, "out_len": 6, "ratio": 1.0},
    "mixed": {"n": 12, "in_len": 64, "out_len": 12, "ratio": 0.25},
    "prefix": {
        "few_shot": {"prefix_len": 256, "num_questions": 8, "question_len": 8, "output_len": 4},
        "tree": {
            "num_roots": 2,
            "branches": 3,
            "root_len": 64,
            "root_output_len": 6,
            "branch_len": 8,
            "branch_output_len": 4,
        },
        "multi_turn": {"num_sessions": 3, "turns": 3, "system_len": 64, "user_len": 8, "output_len": 4},
    },
    "forks": {"shared_len": 128, "forks": 3, "output_len": 32},
    "json": {"batch": 2, "max_new_tokens": 256},
    "serving": {"num_requests": 6, "input_len": 32, "output_len": 6, "ratio": 0.5, "rates": ["inf", 4]},
    "programs": {"batch": 2, "kinds": ["few_shot_qa"]},
    "speculative": {"b1_new": 12, "batch": 3, "batch_new": 6, "reps": 1},
    # fp8 weights on the CPU are dequantized on every matmul: its batch-1 decode times that alone
    # (a third of the small run) and feeds no ratio; fp8_b128 reads b128
    "quant_workloads": {"fp8": ("b128",)},
    "timeouts": {"engine": 600, "radix_off": 300, "hf": 300, "server": 300, "quant": 600},
}
WORKERS = ("engine", "radix_off", "hf", "server", "quant")


def engine_kwargs(sizes: dict[str, Any], device: str) -> dict[str, Any]:
    return {"device": device, **sizes["engine"]}


# ---------------------------------------------------------------- workers (one process each)


def worker_engine(sizes: dict[str, Any], device: str) -> dict[str, Any]:
    import suite_serving
    import suite_speculative
    import suite_workloads as w

    from radixlm.backend.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(**engine_kwargs(sizes, device))
    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - t0, "defaults": engine_defaults(engine)}
    try:
        steps = [
            ("decode_b1", lambda: w.decode_b1(engine, **sizes["decode_b1"])),
            ("b128", lambda: w.batch_throughput(engine, **sizes["b128"])),
            ("prefix", lambda: w.prefix_workloads(engine, sizes["prefix"], "default")),
            ("prefix_cascade_off", lambda: prefix_cascade_off(engine, sizes)),
            ("forks", lambda: w.fork_program(engine, **sizes["forks"])),
            ("json", lambda: w.json_decoding(engine, **sizes["json"])),
            ("serving", lambda: suite_serving.engine_side(engine, sizes["serving"])),
            ("mixed", lambda: w.batch_throughput(engine, **sizes["mixed"])),
            ("mixed_unsplit", lambda: mixed_unsplit(engine, sizes)),
            ("programs", lambda: programs_overhead(engine, sizes["programs"])),
            ("speculative", lambda: suite_speculative.speculative_rows(engine, **sizes["speculative"])),
        ]
        only = _PARTIAL.get("engine_steps")
        for name, fn in steps:
            if only and name not in only.split(","):
                continue
            w.run_step(out, name, fn, "engine")
            yield_partial(out)
    finally:
        engine.shutdown()
    return out


def engine_defaults(engine: Any) -> dict[str, Any]:
    from radixlm.kernels import _triton

    cfg = engine.scheduler.cfg
    graphs = engine.runner.graph_runner
    return {
        "max_running_requests": cfg.max_running_requests,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "overlap": cfg.overlap,
        "cascade": cfg.enable_cascade,
        "kv_slots": engine.runner.allocator.size,
        "cuda_graph_max_bs": graphs.max_bs if graphs is not None else None,
        "piecewise_max_tokens": pieces.max_tokens if (pieces := engine.runner.piecewise) is not None else 0,
        "pdl_kernels": sorted(_triton.PDL_ON),  # launched with PDL where the GPU has it (sm_90+)
    }


def prefix_cascade_off(engine: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    import suite_workloads as w

    w.set_cascade(engine, False)
    try:
        return w.prefix_workloads(engine, sizes["prefix"], "cascade off")
    finally:
        w.set_cascade(engine, True)


def mixed_unsplit(engine: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    """The mixed workload again, with every mixed step run as one extend (the default runs its
    leading decode rows through decode attention, backend/attention_triton.py); skipped where the
    backend has no such split."""
    import suite_workloads as w

    backend = engine.runner.attn_backend
    if not hasattr(backend, "mixed_decode_min_rows"):
        return {"skipped": f"{type(backend).__name__} runs mixed steps as one pass"}
    before = backend.mixed_decode_min_rows
    w.on_scheduler(engine, lambda: setattr(backend, "mixed_decode_min_rows", None))
    try:
        return w.batch_throughput(engine, **sizes["mixed"])
    finally:
        w.on_scheduler(engine, lambda: setattr(backend, "mixed_decode_min_rows", before))


def programs_overhead(engine: Any, size: dict[str, Any]) -> dict[str, Any]:
    """DSL programs vs the same engine calls replayed raw (benchmarks/programs.py; median of the
    repeats, alternating, since one run of 16 programs is too short to tell overhead from noise)."""
    import programs

    loads = programs.workloads(size["batch"])
    out = {}
    for kind in size["kinds"]:
        program, batch = loads[kind]
        r = programs.measure(engine, program, batch, repeats=size.get("repeats", 1))
        out[kind] = {k: v for k, v in r.items() if not isinstance(v, (list, dict))}
    return out


def worker_radix_off(sizes: dict[str, Any], device: str) -> dict[str, Any]:
    import suite_workloads as w

    from radixlm.backend.engine import Engine

    engine = Engine(disable_radix_cache=True, **engine_kwargs(sizes, device))
    try:
        return {"prefix": w.prefix_workloads(engine, sizes["prefix"], "radix off")}
    finally:
        engine.shutdown()


def worker_hf(sizes: dict[str, Any], device: str) -> dict[str, Any]:
    """HF transformers generate on the b128 workload (the same requests), batch = all of them."""
    import torch
    from offline_throughput import hf_model_for, make_workload, run_hf

    s = sizes["b128"]
    shape = sizes["engine"].get("model_shape")
    fake = type(
        "E",
        (),
        {
            "runner": type("R", (), {"dtype": torch.bfloat16 if device == "cuda" else torch.float32})(),
            "device": torch.device(device),
        },
    )()
    model = hf_model_for(fake, argparse.Namespace(model_shape=shape, model_path=None))
    vocab = model.config.vocab_size
    work = make_workload(s["n"], s["in_len"], s["out_len"], s["ratio"], vocab, seed=0)
    return {"b128": run_hf(model, work, s["n"], torch.device(device))}


def worker_server(sizes: dict[str, Any], device: str) -> dict[str, Any]:
    import suite_serving

    return {"serving": suite_serving.server_side(sizes["serving"], engine_kwargs(sizes, device))}


def worker_quant(sizes: dict[str, Any], device: str) -> dict[str, Any]:
    import suite_quant

    return {
        "quant": suite_quant.quant_rows(
            sizes, engine_kwargs(sizes, device), lambda o: yield_partial({"quant": o})
        )
    }


_PARTIAL: dict[str, str] = {}


def yield_partial(out: dict[str, Any]) -> None:
    """Write what a worker has so far, so a worker stopped by its time limit still reports."""
    if _PARTIAL.get("path"):
        Path(_PARTIAL["path"]).write_text(json.dumps(strip_private(out), default=str))


def strip_private(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: strip_private(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, list):
        return [strip_private(v) for v in x]
    return x


# ---------------------------------------------------------------- orchestration


def run_worker(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    fd, path = tempfile.mkstemp(suffix=f"_{name}.json")
    os.close(fd)
    cmd = [sys.executable, __file__, "--worker", name, "--partial-out", path, "--device", args.device]
    if args.engine_steps:
        cmd += ["--engine-steps", args.engine_steps]
    if args.small:
        cmd.append("--small")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f} s"
    text = Path(path).read_text()
    os.unlink(path)
    res = json.loads(text) if text.strip() else {}
    res["_worker"] = {"status": status, "wall_s": time.perf_counter() - t0}
    print(f"worker {name}: {status} ({res['_worker']['wall_s']:.1f} s)", flush=True)
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--small", action="store_true", help="CPU-sized workloads on the default model")
    p.add_argument("--workers", default=",".join(WORKERS), help=f"comma list of {WORKERS}")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/suite_<device>.json)")
    p.add_argument("--compare", default=None, help="an earlier suite JSON: exit 1 if any ratio fell by > 5%%")
    p.add_argument(
        "--readme",
        default=None,
        help="write README.md's Measured section from these suite JSONs (comma list: a full run, "
        "then partial runs whose rows replace its rows; PATH=row+row takes only those rows)",
    )
    p.add_argument(
        "--engine-steps",
        default=None,
        help="comma list: run only these workloads in the engine worker (a partial run)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--partial-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.workers = [x for x in args.workers.split(",") if x]
    bad = set(args.workers) - set(WORKERS)
    if bad:
        p.error(f"unknown workers {sorted(bad)}; choose from {WORKERS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme:
        runs = []
        for item in args.readme.split(","):
            path, _, rows = item.partition("=")
            result = json.loads(Path(path).read_text())
            if rows:  # a partial run whose other rows measured less than the full run's did
                keep = set(rows.split("+"))
                result = {**result, "ratios": {k: v for k, v in result["ratios"].items() if k in keep}}
            runs.append((path, result))
        suite_report.write_readme(runs, Path(__file__).parent.parent / "README.md")
        return 0
    sizes = SMALL if args.small else FULL
    if args.worker:
        _PARTIAL["path"] = args.partial_out
        _PARTIAL["engine_steps"] = args.engine_steps or ""
        fn = {
            "engine": worker_engine,
            "radix_off": worker_radix_off,
            "hf": worker_hf,
            "server": worker_server,
            "quant": worker_quant,
        }
        yield_partial(fn[args.worker](sizes, args.device))
        return 0
    env = environment()
    out = Path(args.out or RESULTS / f"suite_{device_tag(env)}.json")
    result: dict[str, Any] = {
        "benchmark": "suite",
        "env": env,
        "small": args.small,
        "sizes": sizes,
        "workers": {},
    }
    t0 = time.perf_counter()
    for name in args.workers:
        result["workers"][name] = run_worker(name, args, sizes["timeouts"][name])
        result["wall_s"] = time.perf_counter() - t0
        result["ratios"] = suite_report.ratios(result)
        write_result(out, result)
    suite_report.write_markdown(result, out.with_suffix(".md"))
    suite_report.plot(result, out.with_suffix(".png"))
    print(suite_report.table(result))
    if args.compare:
        fell = suite_report.compare(json.loads(Path(args.compare).read_text()), result)
        for line in fell:
            print("FELL:", line)
        return 1 if fell else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
