"""Where the scheduler's host launch time goes (build the batch, run the forward, launch sampling),
per step and split by graph-replayed and eager forwards: on the suite's mixed workload (prefill
chunks beside decodes), plainly and under cProfile, whose two walls tell whether the host limits
it; and on lone prompts, one at a time, whose launches start on an idle device and so time the
host's own cost of an eager forward. Prints the functions by own time under cProfile and every
host-device sync inside a profiled launch by call site; writes the figures as JSON. Meant for the
GPU (`--device cpu` is a smoke run)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import make_workload  # noqa: E402

from radixlm.backend import model_runner, scheduler  # noqa: E402
from radixlm.backend.engine import Engine  # noqa: E402
from radixlm.kernels import compiled_kernel_count  # noqa: E402


class LaunchTimer:
    """Wraps Scheduler.launch and ModelRunner.forward: per-step host seconds by forward kind,
    and (when profiling) cProfile plus sync warnings inside launches only."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {"graph": [], "eager": []}
        self.forward_s: dict[str, list[float]] = {"graph": [], "eager": []}
        self.tokens: dict[str, list[int]] = {"graph": [], "eager": []}
        self.profile: cProfile.Profile | None = None  # on while set
        self.last_profile = cProfile.Profile()
        self.syncs: Counter[str] = Counter()
        self._kind = "eager"
        self._sync_mode = torch.cuda.set_sync_debug_mode if torch.cuda.is_available() else (lambda _: None)
        launch, forward = scheduler.Scheduler.launch, model_runner.ModelRunner.forward

        def timed_launch(sched: Any, plan: Any) -> Any:
            t0 = time.perf_counter()
            if self.profile is not None:
                self._sync_mode(1)
                self.profile.enable()
            try:
                return launch(sched, plan)
            finally:
                if self.profile is not None:
                    self.profile.disable()
                    self._sync_mode(0)
                self.times[self._kind].append(time.perf_counter() - t0)
                self.tokens[self._kind].append(sum(len(it.token_ids) for it in plan.items))

        def timed_forward(runner: Any, fb: Any) -> Any:
            graphs = runner.graph_runner
            self._kind = "graph" if graphs is not None and graphs.can_run(fb) else "eager"
            t0 = time.perf_counter()
            try:
                return forward(runner, fb)
            finally:
                self.forward_s[self._kind].append(time.perf_counter() - t0)

        scheduler.Scheduler.launch = timed_launch  # type: ignore[method-assign]
        model_runner.ModelRunner.forward = timed_forward  # type: ignore[method-assign]

    def on_warning(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "radixlm" in f.filename]
        site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        self.syncs[site or f"{filename}:{lineno}"] += 1

    def reset(self) -> None:
        for d in (self.times, self.forward_s, self.tokens):
            for v in d.values():
                v.clear()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, ts in self.times.items():
            if ts:
                fw = self.forward_s[kind]
                out[kind] = {
                    "steps": len(ts),
                    "launch_ms_mean": 1e3 * sum(ts) / len(ts),
                    "forward_ms_mean": 1e3 * sum(fw) / max(len(fw), 1),
                    "tokens_mean": sum(self.tokens[kind]) / len(ts),
                    "launch_s_total": sum(ts),
                }
        return out


def mixed_runs(eng: Engine, timer: LaunchTimer, args: argparse.Namespace) -> dict[str, Any]:
    """The mixed workload plain, then under cProfile: the two walls tell whether host time
    limits it (a slower host under the profiler then slows the run)."""
    work = make_workload(args.requests, args.in_len, args.out_len, 0.25, eng.model_config.vocab_size, seed=0)
    ids = [w for w, _ in work]
    sps = [{"max_new_tokens": o, "ignore_eos": True, "temperature": 0} for _, o in work]
    eng.generate(input_ids=ids[:32], sampling_params=sps[:32])  # first-use costs out of the way
    res: dict[str, Any] = {}
    for label, profiled in (("plain", False), ("profiled", True)):
        eng.flush_cache()
        timer.reset()
        timer.profile = timer.last_profile if profiled else None
        t0 = time.perf_counter()
        eng.generate(input_ids=ids, sampling_params=sps)
        res[label] = {"wall_s": time.perf_counter() - t0, **timer.summary()}
        timer.profile = None
        print(label, json.dumps(res[label], indent=1), flush=True)
    return res


def lone_prompts(eng: Engine, timer: LaunchTimer, lengths: list[int], reps: int) -> dict[str, Any]:
    """One fresh prompt at a time (one output token): each launch starts on an idle device, so
    its time is the host's own cost of a forward of that many tokens (plus any compilation,
    counted beside it). Then the same prompts again under cProfile (the profile
    printed covers the last profiled run)."""
    res: dict[str, Any] = {}
    for label, profiled in (("plain", False), ("profiled", True)):
        for n in lengths:
            timer.reset()
            timer.profile = timer.last_profile if profiled else None
            compiles = compiled_kernel_count()
            for r in range(reps):
                ids = [100 + (r * 7919 + j * 31) % 30000 for j in range(n)]
                eng.flush_cache()
                eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
            timer.profile = None
            row = {
                **timer.summary(),
                "launch_ms_each": [round(1e3 * t, 2) for ts in timer.times.values() for t in ts],
                "kernel_compiles": compiled_kernel_count() - compiles,
            }
            res[f"{label}_{n}"] = row
            print(f"lone prompt of {n} ({label}):", json.dumps(row), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-shape", default="llama-3.1-8b")
    p.add_argument("--requests", type=int, default=400, help="mixed workload size (0: skip it)")
    p.add_argument("--in-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=512)
    p.add_argument("--lone-lengths", default="64,512,2048", help="comma list of lone prompt lengths")
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the script")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    timer = LaunchTimer()
    warnings.showwarning = timer.on_warning  # type: ignore[assignment]
    warnings.simplefilter("always")
    eng = Engine(model_shape=args.model_shape, device=args.device, context_length=16384)
    try:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
        res: dict[str, Any] = {"args": vars(args), "gpu": gpu, "torch": torch.__version__}
        if args.requests:
            res.update(mixed_runs(eng, timer, args))
        lengths = [int(x) for x in args.lone_lengths.split(",") if x]
        res["lone_prompts"] = lone_prompts(eng, timer, lengths, reps=8)
        text = io.StringIO()
        stats = pstats.Stats(timer.last_profile, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        res["syncs"] = dict(timer.syncs.most_common())
        print(text.getvalue())
        print("syncs inside profiled launches:", json.dumps(res["syncs"], indent=1))
        res["cprofile"] = text.getvalue()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
