"""Garbage-collector pauses inside the engine, with the started engine's heap frozen (gc.freeze, as
vLLM and SGLang do after start-up) and unfrozen, side by side in one process on one engine: every
collector pass during a batch of few-shot requests (one long shared prefix, many short questions)
is recorded through gc.callbacks, by generation, with the engine's host phase times; and one full
collection is timed directly.

    python benchmarks/gc_pauses.py [--rounds 3] [--out benchmarks/results/gc_pauses_cpu.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_env import device_tag, environment, write_result  # noqa: E402
from suite_workloads import CollectorPauses  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402

PHASES = ("host_schedule_us", "host_launch_us", "host_process_us")


def full_collection_ms() -> float:
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1e3


def few_shot(
    engine: Engine, log: CollectorPauses, rng: random.Random, args: argparse.Namespace
) -> dict[str, Any]:
    prefix = [rng.randrange(100, 40_000) for _ in range(args.prefix_len)]
    engine.flush_cache()
    engine.generate(input_ids=[prefix + [5]], sampling_params={"max_new_tokens": 1})
    prompts = [prefix + [rng.randrange(100, 40_000) for _ in range(48)] for _ in range(args.requests)]
    params = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
    log.passes.clear()
    before, t = engine.get_stats(), time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    wall, after = time.perf_counter() - t, engine.get_stats()
    by_gen = {g: [round(s * 1e3, 2) for k, s in log.passes if k == g] for g in (0, 1, 2)}
    return {
        "wall_s": wall,
        **{k: after[k] - before[k] for k in PHASES},
        "passes": {g: len(v) for g, v in by_gen.items()},
        "gen2_pause_ms": by_gen[2],
        "pause_ms_total": round(sum(s for _, s in log.passes) * 1e3, 2),
        "pause_ms_max": round(max((s for _, s in log.passes), default=0.0) * 1e3, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating frozen / unfrozen rounds")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine = Engine()
    rng = random.Random(0)
    res: dict[str, Any] = {"benchmark": "gc_pauses", "env": environment(), "args": vars(args)}
    res["tracked_objects_at_start"] = len(gc.get_objects())
    res["frozen_at_start"] = gc.get_freeze_count()
    runs: dict[str, list[dict[str, Any]]] = {"frozen": [], "unfrozen": []}
    log = CollectorPauses()  # every pass from here on, through gc.callbacks
    try:
        for _ in range(args.rounds):
            for mode in ("unfrozen", "frozen"):
                gc.unfreeze()
                if mode == "frozen":
                    gc.collect()
                    gc.freeze()
                run = few_shot(engine, log, rng, args)
                run["full_collection_ms"] = full_collection_ms()
                runs[mode].append(run)
                print(mode, json.dumps({k: v for k, v in run.items() if k != "gen2_pause_ms"}), flush=True)
    finally:
        engine.shutdown()
    res["runs"] = runs
    write_result(
        args.out or Path(__file__).parent / "results" / f"gc_pauses_{device_tag(res['env'])}.json", res
    )


if __name__ == "__main__":
    main()
