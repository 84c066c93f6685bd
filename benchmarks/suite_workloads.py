"""The end-to-end suite's workloads, run inside one worker process on one Engine built with the
default settings. Each returns plain JSON-able dicts; feature switches are flipped on the live
engine (on its scheduler thread, between runs) so on and off run side by side in one process.
First runs are timed like every other run: nothing is warmed up by the suite itself."""

from __future__ import annotations

import gc
import json
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import forks as forks_bench  # noqa: E402
import prefix_sharing  # noqa: E402
from constrained_decode import SCHEMA  # noqa: E402
from offline_throughput import make_workload  # noqa: E402

from radixlm.backend.cascade_cost import copy_bytes_per_s  # noqa: E402
from radixlm.backend.engine import Engine  # noqa: E402
from radixlm.kernels import compiled_kernel_count, compiled_kernel_variants  # noqa: E402


def run_step(out: dict[str, Any], name: str, fn: Callable[[], Any], tag: str) -> None:
    """out[name] = fn(), timed and printed; an exception is recorded there instead (one broken
    workload must not hide the others' results)."""
    t = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:
        traceback.print_exc()
        out[name] = {"error": f"{type(e).__name__}: {e}"}
    print(f"[{tag}] {name} done in {time.perf_counter() - t:.1f} s", flush=True)


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def on_scheduler(engine: Engine, fn: Any) -> Any:
    """Run fn between steps on the scheduler thread, after the in-flight step is processed."""

    def settled() -> Any:
        engine.scheduler.settle()
        return fn()

    return engine._call(settled)


def set_overlap(engine: Engine, on: bool) -> None:
    on_scheduler(engine, lambda: setattr(engine.scheduler.cfg, "overlap", on))


def set_cascade(engine: Engine, on: bool) -> None:
    on_scheduler(
        engine, lambda: setattr(engine.scheduler.cfg, "enable_cascade", on and engine.runner.supports_cascade)
    )


class CollectorPauses:
    """Every garbage-collector pass in the process (any thread) as (generation, seconds): a full
    pass over a large heap stalls the scheduler thread mid-step, so the suite reports them."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []
        self._start = 0.0
        gc.callbacks.append(self._on_pass)

    def _on_pass(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes.append((info["generation"], time.perf_counter() - self._start))

    def summary(self, since: int) -> dict[str, Any]:
        full = [s for g, s in self.passes[since:] if g == 2]
        return {
            "gc_passes": len(self.passes) - since,
            "gc_full_passes": len(full),
            "gc_full_ms": round(sum(full) * 1e3, 2),
            "gc_ms": round(sum(s for _, s in self.passes[since:]) * 1e3, 2),
        }


PAUSES = CollectorPauses()


class Timed:
    """Wall time of a block (device synchronized), with the engine counters and the Triton
    compilations it caused: the suite counts a compile on the request path as a defect."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.out: dict[str, Any] = {}

    def __enter__(self) -> dict[str, Any]:
        sync(self.engine)
        self.stats0 = self.engine.get_stats()
        self.compiles0 = compiled_kernel_count()
        self.variants0 = compiled_kernel_variants()
        self.gc0 = len(PAUSES.passes)
        self.t0 = time.perf_counter()
        return self.out

    def __exit__(self, *exc: object) -> None:
        sync(self.engine)
        self.out["duration_s"] = time.perf_counter() - self.t0
        after = self.engine.get_stats()
        keys = (
            "forward_passes",
            "generated_tokens",
            "cascade_steps",
            "cached_prompt_tokens",
            "computed_prompt_tokens",
            "jump_forward_passes_saved",
            "num_retractions",
            "cascade_declined_steps",
            "deferred_sampling_steps",
            "host_schedule_us",
            "host_launch_us",
            "host_process_us",
            "wait_device_us",
        )
        self.out.update({k: after.get(k, 0) - self.stats0.get(k, 0) for k in keys})
        self.out["kernel_compiles"] = compiled_kernel_count() - self.compiles0
        self.out.update(PAUSES.summary(self.gc0))
        grew = {k: n - self.variants0.get(k, 0) for k, n in compiled_kernel_variants().items()}
        if any(grew.values()):  # which kernels compiled on the request path
            self.out["compiled_kernels"] = {k: n for k, n in grew.items() if n}


def generate_ids(engine: Engine, prompts: list[list[int]], params: list[dict] | dict) -> dict[str, Any]:
    with Timed(engine) as res:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    aborted = [
        o["meta_info"]["finish_reason"] for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"
    ]
    if aborted:  # a throughput over requests that failed is no throughput
        raise RuntimeError(
            f"{len(aborted)} of {len(outs)} requests aborted, first: {aborted[0].get('message')}"
        )
    res["output_tokens"] = sum(o["meta_info"]["completion_tokens"] for o in outs)
    res["output_tok_s"] = res["output_tokens"] / res["duration_s"]
    res["_outputs"] = [o["output_ids"] for o in outs]
    return res


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


# ---------------------------------------------------------------- throughput workloads


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), the decode roofline's ceiling:
    the engine's own start-up measurement (backend/cascade_cost.py)."""
    return copy_bytes_per_s(device) if device.type == "cuda" else None


def decode_b1(engine: Engine, in_len: int, out_len: int) -> dict[str, Any]:
    """Batch-1 decode tok/s (prefill timed apart and subtracted), overlap on then off, against
    the weight-streaming roofline: each token reads every weight once."""
    rng = random.Random(1)
    prompt = [rng.randrange(100, min(engine.model_config.vocab_size, 32000)) for _ in range(in_len)]
    res: dict[str, Any] = {}
    for overlap in (True, False):
        set_overlap(engine, overlap)
        runs = []
        for _ in range(3):  # the median of three: one run is ~1 s and moves by a few percent
            engine.flush_cache()
            prefill = generate_ids(engine, [prompt], greedy(1))
            engine.flush_cache()
            full = generate_ids(engine, [prompt], greedy(out_len))
            runs.append(((out_len - 1) / (full["duration_s"] - prefill["duration_s"]), prefill, full))
        rate, prefill, full = sorted(runs, key=lambda x: x[0])[1]
        res["overlap_on" if overlap else "overlap_off"] = {
            "decode_tok_s": rate,
            "all_decode_tok_s": [r[0] for r in runs],
            "prefill_s": prefill["duration_s"],
            "kernel_compiles": sum(r[1]["kernel_compiles"] + r[2]["kernel_compiles"] for r in runs),
        }
    set_overlap(engine, engine.device.type == "cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    bw = copy_bandwidth(engine.device)
    res["weight_bytes"] = weight_bytes
    if bw:
        res["copy_bytes_per_s"] = bw
        res["roofline_tok_s"] = bw / weight_bytes
        res["fraction_of_roofline"] = res["overlap_on"]["decode_tok_s"] / res["roofline_tok_s"]
    return res


def batch_throughput(engine: Engine, n: int, in_len: int, out_len: int, ratio: float) -> dict[str, Any]:
    """n requests at once (random ids, fixed seeds): output tok/s, the same set every run."""
    work = make_workload(n, in_len, out_len, ratio, engine.model_config.vocab_size, seed=0)
    engine.flush_cache()
    res = generate_ids(engine, [ids for ids, _ in work], [greedy(o) for _, o in work])
    res.pop("_outputs")
    res["requests"] = n
    return res


# ---------------------------------------------------------------- prefix sharing and cascade


def prefix_workloads(engine: Engine, sizes: dict[str, dict], label: str) -> dict[str, Any]:
    """few-shot, fork tree and multi-turn (benchmarks/prefix_sharing.py) on this engine."""
    out: dict[str, Any] = {}
    for name, fn in prefix_sharing.WORKLOADS.items():
        engine.flush_cache()
        r = prefix_sharing.Runner(engine, engine.model_config.vocab_size, seed=0)
        with Timed(engine) as res:
            fn(r, **sizes[name])
        res.update(
            output_tokens=r.output_tokens,
            output_tok_s=r.output_tokens / res["duration_s"],
            hit_rate=r.cached_tokens / max(r.prompt_tokens, 1),
            _outputs=r.outputs,
        )
        print(
            f"  {label:12s} {name:10s} {res['output_tok_s']:9.1f} out tok/s  {res['duration_s']:.2f} s  "
            f"cascade steps {res['cascade_steps']}  compiles {res['kernel_compiles']}",
            flush=True,
        )
        out[name] = res
    return out


def fork_program(engine: Engine, shared_len: int, forks: int, output_len: int) -> dict[str, Any]:
    """The fork-heavy program (benchmarks/forks.py): cascade on, off, on again on one engine."""
    runtime = forks_bench.RecordingRuntime(engine)
    document, n_doc = forks_bench.synthetic_document(engine.tokenizer, shared_len, seed=0)
    args = type("Args", (), {"forks": forks, "output_len": output_len})()
    c0 = compiled_kernel_count()
    runs = []
    for cascade in (True, False, True):
        set_cascade(engine, cascade)
        runs.append(forks_bench.run_mode(runtime, cascade, document, args))
    set_cascade(engine, True)
    res: dict[str, Any] = {
        "shared_tokens": n_doc,
        "runs": [r["result"] for r in runs],
        "kernel_compiles": compiled_kernel_count() - c0,
    }
    res["greedy_match_on_vs_off"] = forks_bench.match_fraction(runs[0]["outputs"], runs[1]["outputs"])
    return res


# ---------------------------------------------------------------- constrained decoding


def json_decoding(engine: Engine, batch: int, max_new_tokens: int) -> dict[str, Any]:
    """JSON-schema decoding at batch B: the engine's first constrained batch on its default
    settings, then jump-forward on and off, then free decoding of exactly the token counts the
    no-jump-forward run produced per request (same work, no grammar); every finished
    constrained output is validated."""
    tok = engine.tokenizer
    prompt = tok.encode("Generate a JSON record of a fictional employee:\n")
    prompts = [prompt + tok.encode(f" #{i}\n") for i in range(batch)]
    base = {"max_new_tokens": max_new_tokens, "temperature": 0.7, "seed": 1, "json_schema": SCHEMA}
    res: dict[str, Any] = {}
    lengths: list[int] = []
    default_jf = not engine.disable_jump_forward
    res["default_jump_forward"] = default_jf
    for name, jf in (("default_first", default_jf), ("jump_forward", True), ("no_jump_forward", False)):
        engine.disable_jump_forward = not jf
        engine.flush_cache()
        with Timed(engine) as r:
            outs = engine.generate(input_ids=prompts, sampling_params=base)
        lengths = [max(o["meta_info"]["completion_tokens"], 1) for o in outs]
        r["output_tokens"] = sum(lengths)
        r["output_tok_s"] = r["output_tokens"] / r["duration_s"]
        finished = [o for o in outs if (o["meta_info"]["finish_reason"] or {}).get("type") == "stop"]
        r["finished"] = len(finished)  # the rest hit max_new_tokens: cut JSON, not judged
        r["valid_fraction"] = (
            sum(_validates(o["text"]) for o in finished) / len(finished) if finished else None
        )
        res[name] = r
    engine.disable_jump_forward = not default_jf
    engine.flush_cache()
    free = generate_ids(
        engine,
        prompts,
        [{"max_new_tokens": n, "temperature": 0.7, "seed": 1, "ignore_eos": True} for n in lengths],
    )
    free.pop("_outputs")
    res["free_same_lengths"] = free
    return res


def _validates(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
