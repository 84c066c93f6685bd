"""Collector thresholds on the default path, side by side on one engine: Python's defaults
(700, 10, 10) against raised ones, alternating per round, on the suite's mixed workload (1,000
requests), its prefix workloads and batch-1 decode. The prefix workloads' outputs stay referenced,
as in the suite, so full passes walk a heap like the suite's. Every collector pass inside each
workload is recorded (gc.callbacks, suite_workloads.Timed).

    python benchmarks/gc_thresholds.py --device cuda [--rounds 2] [--raised 100000,50,100]
    python benchmarks/gc_thresholds.py --device cpu --small
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite  # noqa: E402
import suite_workloads as w  # noqa: E402
from bench_env import device_tag, environment, write_result  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402

PYTHON_DEFAULT = (700, 10, 10)
KEEP = ("duration_s", "output_tok_s", "forward_passes", "gc_passes", "gc_full_passes", "gc_full_ms", "gc_ms")


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run[k] for k in KEEP if k in run}


def one_round(engine: Engine, sizes: dict[str, Any], kept: list[Any]) -> dict[str, Any]:
    """The workloads once, under whatever thresholds are set now."""
    b1 = w.decode_b1(engine, **sizes["decode_b1"])["overlap_on"]
    out: dict[str, Any] = {"decode_b1": {"decode_tok_s": b1["decode_tok_s"]}}
    prefix = w.prefix_workloads(engine, sizes["prefix"], "gc")
    for name, run in prefix.items():
        kept.append(run.pop("_outputs", None))  # the suite keeps them to compare radix on and off
        out[name] = _summary(run)
    out["mixed"] = _summary(w.batch_throughput(engine, **sizes["mixed"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="the suite's small sizes (the default model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--raised", default="100000,50,100", help="gen0,gen1,gen2 thresholds to compare")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sizes = suite.SMALL if args.small else suite.FULL
    raised = tuple(int(x) for x in args.raised.split(","))
    engine = Engine(**suite.engine_kwargs(sizes, args.device))
    res: dict[str, Any] = {"benchmark": "gc_thresholds", "env": environment(), "args": vars(args)}
    runs: dict[str, list[dict[str, Any]]] = {"python_default": [], "raised": []}
    kept: list[Any] = []
    try:
        one_round(engine, sizes, kept)  # warm-up: kernels, graphs, allocator
        for _ in range(args.rounds):
            for mode, thresholds in (("python_default", PYTHON_DEFAULT), ("raised", raised)):
                gc.set_threshold(*thresholds)
                run = one_round(engine, sizes, kept)
                runs[mode].append(run)
                print(mode, json.dumps(run), flush=True)
    finally:
        engine.shutdown()
    res["runs"] = runs
    res["tracked_objects_at_end"] = len(gc.get_objects())
    write_result(
        args.out or Path(__file__).parent / "results" / f"gc_thresholds_{device_tag(res['env'])}.json", res
    )


if __name__ == "__main__":
    main()
