"""Where a large batch's speculative runs lose time: the suite's batch_auto workload (B copy-heavy
prompts, n-gram drafts, automatic policy), with every decode-only step's kind, size, drafts, wall
time (the policy's measure, and the whole Scheduler.step including settling the overlapped step)
and host time per phase (schedule, draft, forward, verify, process) logged, per timed run.
Writes JSON to the path given.

    python benchmarks/h200/spec_trace.py OUT.json [--batch 64] [--new 64] [--reps 4]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
import speculative as spec_bench  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    t0 = time.perf_counter()
    kw = {"model_shape": args.shape, "context_length": 16384} if args.device == "cuda" else {}
    engine = Engine(device=args.device, **kw)
    start_s = time.perf_counter() - t0
    spec = engine.scheduler.spec
    steps: list[dict[str, object]] = []
    record = spec.record_step

    def traced(verify_step: bool, batch: int, drafts: int, seconds: float) -> None:
        pol = spec.policy
        steps.append(
            {
                "verify": verify_step,
                "batch": batch,
                "drafts": drafts,
                "ms": round(seconds * 1e3, 3),
                "ready": pol.costs.ready(batch),
                "alpha": round(pol.alpha, 3),
                "learn_skip": pol.learn_skip,
                "declined": pol.declined,
            }
        )
        record(verify_step, batch, drafts, seconds)

    spec.record_step = traced  # type: ignore[method-assign]
    sch = engine.scheduler
    phases: dict[str, float] = {}

    def timed(obj: object, name: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a: object, **k: object) -> object:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + (time.perf_counter() - t) * 1e3

        setattr(obj, name, wrapper)

    for obj, name in [
        (sch.planner, "schedule"),
        (spec, "draft"),
        (sch.runner, "forward"),
        (spec, "verify"),
        (sch, "_process_step"),
        (sch, "launch"),
    ]:
        timed(obj, name)
    step_fn = sch.step

    def whole_step() -> bool:
        n, t = len(steps), time.perf_counter()
        phases.clear()
        try:
            return step_fn()
        finally:
            if len(steps) > n:
                steps[-1]["step_ms"] = round((time.perf_counter() - t) * 1e3, 3)
                steps[-1]["phases_ms"] = {k: round(v, 3) for k, v in phases.items()}

    sch.step = whole_step  # type: ignore[method-assign]
    rng = random.Random(0)
    many = [spec_bench.code_edit(rng) for _ in range(args.batch)]
    spec_bench.run_once(engine, many, 4, "none")
    runs = []
    try:
        for r in range(args.reps):
            for alg in ("none", "ngram") if r % 2 == 0 else ("ngram", "none"):
                steps.clear()
                res = spec_bench.run_once(engine, many, args.new, alg)
                res.pop("ids")
                costs = spec.policy.costs
                fits = {
                    str(b): {"n": f.n, "a_ms": f.predict(0.0) * 1e3, "b_ms": f.slope * 1e3}
                    for b, f in costs.extra.items()
                }
                runs.append(
                    {
                        "alg": alg,
                        **res,
                        "steps": list(steps),
                        "decode_fit": {
                            "a_ms": costs.decode.predict(0) * 1e3,
                            "b_ms": costs.decode.slope * 1e3,
                        },
                        "extra_fits": fits,
                    }
                )
                print(
                    alg, round(res["tok_s"]), res["spec_verify_steps"], res["spec_draft_tokens"], flush=True
                )
    finally:
        engine.shutdown()
    Path(args.out).write_text(json.dumps({"engine_start_s": start_s, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
