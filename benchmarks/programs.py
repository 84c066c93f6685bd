"""Program benchmark (issue 5): `run_batch` of each example kind on the in-process Runtime,
against raw `Engine.generate` calls doing the same token work. The program run is recorded
(every engine call: its token ids, sampling params, and when it started and ended); the raw
run replays exactly those calls straight on the engine, one thread per program state, each
call waiting only for the calls that had ended before it started in the recording. So the
raw run has the same requests and the same ordering, minus the interpreter.

    python benchmarks/programs.py [--kinds few_shot_qa,react_agent] [--batch 4] [--repeats 2]

Writes benchmarks/results/programs_<device>.json: per kind, program and raw wall and CPU
times (alternating repeats after one warm-up run, radix cache flushed before each), output
tokens/s, programs/s, and the overhead three ways (see `measure`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import radixlm as sgl
from radixlm.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workloads(batch: int) -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    """kind → (program, batch of kwargs). Inputs are the examples' own, cycled to `batch`."""

    def cycle(items: list[Any]) -> list[Any]:
        return [items[i % len(items)] for i in range(batch)]

    qs = load_example("quickstart")
    fs = load_example("few_shot_qa")
    js = load_example("json_extraction")
    ra = load_example("react_agent")
    tot = load_example("tree_of_thought")
    ps = load_example("parallel_summarisation")
    questions = ["Why is the sky blue?", "Why do cats purr?", "What makes rain?", "Why is sea water salty?"]
    problems = ["12 sheep plus 5 sheep?", "3 boxes of 4 apples?", "20 minus 7?", "Half of 18?"]
    docs = [ps.DOCUMENT, ps.DOCUMENT[::-1], ps.DOCUMENT[1:], ps.DOCUMENT[:2]]
    return {
        "quickstart": (qs.quick_chat, [{"question": q} for q in cycle(questions)]),
        "few_shot_qa": (fs.few_shot_qa, [{"question": q} for q in cycle(fs.QUESTIONS)]),
        "json_extraction": (js.extract_person, [{"text": t} for t in cycle(js.TEXTS)]),
        "react_agent": (
            ra.react_agent,
            [{"question": q} for q in cycle(["How high is Mount Everest?", "Who created Python?"])],
        ),
        "tree_of_thought": (tot.tree_of_thought, [{"problem": p} for p in cycle(problems)]),
        "parallel_summarisation": (ps.summarise, [{"paragraphs": d} for d in cycle(docs)]),
    }


class RecordingRuntime(Runtime):
    """Runtime that logs every engine call with its thread and start/end ticks."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine=engine)
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._tick = 0

    def _next_tick(self) -> int:
        with self._lock:
            self._tick += 1
            return self._tick

    def _log(self, kind: str, fn: Any, **payload: Any) -> Any:
        call = {
            "kind": kind,
            "thread": threading.get_ident(),
            "start": self._next_tick(),
            "t0": time.perf_counter(),
            **payload,
        }
        out = fn()
        if kind == "stream":
            out = list(out)
        call["t1"] = time.perf_counter()
        call["end"] = self._next_tick()
        call["result"] = out
        with self._lock:
            self.calls.append(call)
        return iter(out) if kind == "stream" else out

    def _request(self, input_ids, sampling, **logprob):
        return self._log(
            "generate",
            lambda: Runtime._request(self, input_ids, sampling, **logprob),
            input_ids=input_ids,
            sampling=dict(sampling),
            logprob=logprob,
        )

    def _request_stream(self, input_ids, sampling, **logprob):
        return self._log(
            "stream",
            lambda: Runtime._request_stream(self, input_ids, sampling, **logprob),
            input_ids=input_ids,
            sampling=dict(sampling),
            logprob=logprob,
        )

    def pin_prefix(self, ids):
        return self._log("pin", lambda: Runtime.pin_prefix(self, ids), input_ids=list(ids))

    def unpin_prefix(self, handle):
        return self._log("unpin", lambda: Runtime.unpin_prefix(self, handle), handle=handle)


def replay(engine: Any, calls: list[dict[str, Any]]) -> float:
    """Run the recorded calls on the engine with the recorded happens-before order."""
    by_end = sorted(calls, key=lambda c: c["end"])
    done = {id(c): False for c in calls}
    frontier = [0]  # all calls with end tick <= frontier[0] are done
    cond = threading.Condition()
    handles: dict[Any, Any] = {}

    def advance() -> None:
        i = next((k for k, c in enumerate(by_end) if not done[id(c)]), len(by_end))
        frontier[0] = by_end[i - 1]["end"] if i else 0

    need = {id(c): max((d["end"] for d in calls if d["end"] < c["start"]), default=0) for c in calls}

    def run_call(c: dict[str, Any]) -> None:
        with cond:
            cond.wait_for(lambda: frontier[0] >= need[id(c)])
        if c["kind"] == "pin":
            handles[c["result"]] = engine.pin_prefix(c["input_ids"])
        elif c["kind"] == "unpin":
            engine.unpin_prefix(handles.pop(c["handle"]))
        elif c["kind"] == "stream":
            for _ in engine.generate(
                input_ids=c["input_ids"], sampling_params=c["sampling"], stream=True, **c["logprob"]
            ):
                pass
        else:
            engine.generate(input_ids=c["input_ids"], sampling_params=c["sampling"], **c["logprob"])
        with cond:
            done[id(c)] = True
            advance()
            cond.notify_all()

    per_thread: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for c in sorted(calls, key=lambda c: c["start"]):
        per_thread[c["thread"]].append(c)
    threads = [threading.Thread(target=lambda cs=cs: [run_call(c) for c in cs]) for cs in per_thread.values()]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def output_tokens(calls: list[dict[str, Any]]) -> int:
    n = 0
    for c in calls:
        res = c["result"]
        if c["kind"] == "generate":
            n += sum(r["meta_info"]["completion_tokens"] for r in res)
        elif c["kind"] == "stream" and res:
            n += res[-1]["meta_info"]["completion_tokens"]
    return n


def engine_busy_s(calls: list[dict[str, Any]], t_start: float, t_end: float) -> float:
    """Length of the union of the calls' [t0, t1] intervals (time some engine call was in flight)."""
    busy, cur_s, cur_e = 0.0, None, None
    for c in sorted(calls, key=lambda c: c["t0"]):
        s, e = max(c["t0"], t_start), min(c["t1"], t_end)
        if cur_e is None or s > cur_e:
            busy += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + (0.0 if cur_e is None else cur_e - cur_s)


_WORK_KEYS = ("forward_passes", "computed_prompt_tokens", "cached_prompt_tokens", "generated_tokens")


def timed(engine: Any, fn: Any) -> tuple[float, float, dict[str, int]]:
    """(wall s, process CPU s — all threads, engine work counters) of fn()."""
    s0 = engine.get_stats()
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    w, c = time.perf_counter() - w0, time.process_time() - c0
    s1 = engine.get_stats()
    return w, c, {k: s1[k] - s0[k] for k in _WORK_KEYS if k in s0}


def measure(engine: Any, program: Any, batch: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Alternate program runs and raw replays (cache flushed before each); three views of the
    overhead: wall time side by side, process CPU time side by side, and — within each program
    run, so immune to the machine's load drifting between runs — the time no engine call was
    in flight (pure interpreter time on the critical path) relative to engine-busy time."""
    prog_w, prog_c, raw_w, raw_c, idle, calls, work = [], [], [], [], [], [], []
    program.run_batch(
        batch, backend=Runtime(engine=engine), temperature=0
    )  # warm caches (grammars, allocator)
    for _ in range(repeats):
        rec = RecordingRuntime(engine)
        engine.flush_cache()
        t0 = time.perf_counter()
        w, c, prog_work = timed(engine, lambda rec=rec: program.run_batch(batch, backend=rec, temperature=0))
        busy = engine_busy_s(rec.calls, t0, t0 + w)
        prog_w.append(w), prog_c.append(c), idle.append((w - busy) / busy)
        calls = rec.calls
        engine.flush_cache()
        w, c, raw_work = timed(engine, lambda calls=calls: replay(engine, calls))
        raw_w.append(w), raw_c.append(c)
        work.append({"program": prog_work, "raw": raw_work})
    med = statistics.median
    toks = output_tokens(calls)
    return {
        "batch": len(batch),
        "engine_calls": len(calls),
        "output_tokens": toks,
        "program_wall_s": prog_w,
        "raw_wall_s": raw_w,
        "program_cpu_s": prog_c,
        "raw_cpu_s": raw_c,
        "program_out_tok_per_s": toks / med(prog_w),
        "raw_out_tok_per_s": toks / med(raw_w),
        "programs_per_s": len(batch) / med(prog_w),
        "overhead_wall": (med(prog_w) - med(raw_w)) / med(raw_w),
        "overhead_cpu": (med(prog_c) - med(raw_c)) / med(raw_c),
        "overhead_idle_in_run": med(idle),
        "forward_passes_program": med(w["program"].get("forward_passes", 0) for w in work),
        "forward_passes_raw": med(w["raw"].get("forward_passes", 0) for w in work),
        # Engine counters per mode. Output tokens and prompt tokens (computed + cached) must be
        # equal; how the prompt splits into radix hits, and the forward-pass count, follow the
        # arrival timing, so they may differ by a little between the two modes.
        "engine_work": work,
        "same_tokens": all(same_tokens(w["program"], w["raw"]) for w in work),
    }


def same_tokens(a: dict[str, int], b: dict[str, int]) -> bool:
    def prompt(x: dict[str, int]) -> int:
        return x["computed_prompt_tokens"] + x["cached_prompt_tokens"]

    return a["generated_tokens"] == b["generated_tokens"] and prompt(a) == prompt(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="all")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--engine-args", default="{}", help="JSON dict of Engine options")
    args = ap.parse_args()

    import torch

    from radixlm.backend.engine import Engine

    engine = Engine(**json.loads(args.engine_args))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loads = workloads(args.batch)
    kinds = list(loads) if args.kinds == "all" else args.kinds.split(",")
    results: dict[str, Any] = {}
    for kind in kinds:
        program, batch = loads[kind]
        try:
            results[kind] = measure(engine, program, batch, args.repeats)
        except ValueError as e:  # e.g. constrained decoding not available in this engine build
            results[kind] = {"skipped": str(e)}
        print(
            kind,
            json.dumps({k: v for k, v in results[kind].items() if not isinstance(v, (list, dict))}),
            flush=True,
        )

    def median_of(key: str) -> float | None:
        vals = [r[key] for r in results.values() if key in r]
        return statistics.median(vals) if vals else None

    out = {
        "benchmark": "programs",
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": str(engine.model_path),
        "batch": args.batch,
        "repeats": args.repeats,
        "results": results,
        "median_overhead_wall": median_of("overhead_wall"),
        "median_overhead_cpu": median_of("overhead_cpu"),
        "median_overhead_idle_in_run": median_of("overhead_idle_in_run"),
        "goal_overhead": 0.05,
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    path = Path(args.out or ROOT / "benchmarks" / "results" / f"programs_{device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print("wrote", path, {k: v for k, v in out.items() if k.startswith("median")})
    engine.shutdown()


if __name__ == "__main__":
    sgl.set_default_backend(None)
    main()
