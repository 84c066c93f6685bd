"""Offline throughput (SGLang's bench_offline_throughput shape): N requests of random tokens
with input/output length ranges and ignore_eos, all submitted at once; output tok/s.
--compare-hf runs HF transformers `generate` on the same workload in the same run.

CPU:  python benchmarks/offline_throughput.py --num-prompts 32 --compare-hf
H200: python benchmarks/offline_throughput.py --model-shape llama-3.1-8b --device cuda \
          --num-prompts 128 --input-len 512 --output-len 256 --range-ratio 1 --compare-hf
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_env import device_tag, environment, write_result  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402


def make_workload(
    n: int, in_len: int, out_len: int, ratio: float, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lo_in, lo_out = max(1, int(in_len * ratio)), max(1, int(out_len * ratio))
    work = []
    for _ in range(n):
        ids = [rng.randrange(100, min(vocab, 32000)) for _ in range(rng.randint(lo_in, in_len))]
        work.append((ids, rng.randint(lo_out, out_len)))
    return work


def run_radixlm(engine: Engine, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    engine.generate(input_ids=[work[0][0][:16]], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    engine.flush_cache()
    params = [{"max_new_tokens": o, "ignore_eos": True, "temperature": 0} for _, o in work]
    sync(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=[ids for ids, _ in work], sampling_params=params)
    sync(engine.device)
    dt = time.perf_counter() - t0
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    in_tokens = sum(len(ids) for ids, _ in work)
    res = {
        "duration_s": dt,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / dt,
        "total_throughput": (out_tokens + in_tokens) / dt,
        "stats": engine.get_stats(),
    }
    if len(work) == 1:  # decode rate alone: the prompt's prefill (+ first token) timed separately
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=[work[0][0]], sampling_params={"max_new_tokens": 1, "ignore_eos": True})
        sync(engine.device)
        res["prefill_s"] = time.perf_counter() - t0
        res["decode_throughput"] = (out_tokens - 1) / (dt - res["prefill_s"])
    return res


def add_roofline(result: dict[str, Any], engine: Engine, args: argparse.Namespace) -> None:
    """Batch-1 decode reads every weight once per token: tok/s <= copy bandwidth / weight bytes."""
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    result["weight_bytes"] = weight_bytes
    if engine.device.type == "cuda" and args.num_prompts == 1:
        roof = args.copy_tbps * 1e12 / weight_bytes
        result["roofline_tok_s"] = roof
        result["fraction_of_roofline"] = result["radixlm"]["decode_throughput"] / roof
        print(f"roofline {roof:.1f} tok/s; fraction {result['fraction_of_roofline']:.3f}")


def overlap_ratio(result: dict[str, Any], toggled_is_on: bool) -> float:
    first, second = (
        result["radixlm"]["output_throughput"],
        result["radixlm_overlap_toggled"]["output_throughput"],
    )
    return second / first if toggled_is_on else first / second


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_model_for(engine: Engine, args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = engine.runner.dtype
    if args.model_shape:
        from radixlm.backend.model_config import NAMED_SHAPES

        cfg = LlamaConfig(**{k: v for k, v in NAMED_SHAPES[args.model_shape].items() if k != "model_type"})
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # build in bf16 directly: no fp32 copy of 8B weights
        try:
            with torch.device(engine.device):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
        return model.eval()
    from radixlm.backend.gguf_loader import export_hf_folder
    from radixlm.backend.loader import default_model_path, resolve_model_dir

    model_path = Path(args.model_path or default_model_path())
    path = (
        export_hf_folder(model_path) if model_path.suffix == ".gguf" else resolve_model_dir(str(model_path))
    )
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(engine.device).eval()


@torch.inference_mode()
def run_hf(model: Any, work: list[tuple[list[int], int]], batch: int, device: torch.device) -> dict[str, Any]:
    """HF generate in batches (left-padded); each request counts only its own output length."""
    pad = 0
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(work), batch):
        part = work[i : i + batch]
        width = max(len(ids) for ids, _ in part)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x, _ in part], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _ in part], device=device)
        new = max(o for _, o in part)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )
        useful += sum(o for _, o in part)
    sync(device)
    dt = time.perf_counter() - t0
    return {"duration_s": dt, "output_tokens": useful, "output_throughput": useful / dt, "batch_size": batch}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument(
        "--model-shape", default=None, help="named real shape with random weights, e.g. llama-3.1-8b"
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.25, help="lengths uniform in [ratio*L, L]")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument(
        "--mem-fraction-static", type=float, default=0.85, help="lower it with --compare-hf on GPU"
    )
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument(
        "--compare-overlap",
        action="store_true",
        help="run again with overlap scheduling off (same engine) and report the ratio",
    )
    p.add_argument(
        "--copy-tbps",
        type=float,
        default=4.24,
        help="HBM copy bandwidth for the weight-streaming roofline (BENCHMARKING.md: 4.24 on the H200)",
    )
    p.add_argument("--hf-batch-size", type=int, default=0, help="default: all prompts in one batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    t_load = time.perf_counter()
    engine = Engine(
        model_path=args.model_path,
        model_shape=args.model_shape,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        mem_fraction_static=args.mem_fraction_static,
        context_length=args.context_length,
    )
    load_s = time.perf_counter() - t_load
    try:
        work = make_workload(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            engine.model_config.vocab_size,
            args.seed,
        )
        result: dict[str, Any] = {
            "benchmark": "offline_throughput",
            "env": environment(),
            "args": vars(args),
            "model": engine.model_config.model_name,
            "engine_load_s": load_s,
            "radixlm": run_radixlm(engine, work),
        }
        print(
            f"radixlm: {result['radixlm']['output_throughput']:.1f} output tok/s "
            f"(overlap {'on' if engine.scheduler.cfg.overlap else 'off'})"
        )
        add_roofline(result, engine, args)
        if args.compare_overlap:
            engine.scheduler.cfg.overlap = not engine.scheduler.cfg.overlap  # the loop is idle: safe
            result["radixlm_overlap_toggled"] = run_radixlm(engine, work)
            result["overlap_on_vs_off"] = overlap_ratio(result, engine.scheduler.cfg.overlap)
            print(
                f"overlap toggled: {result['radixlm_overlap_toggled']['output_throughput']:.1f} tok/s; "
                f"on/off {result['overlap_on_vs_off']:.3f}x"
            )
        if args.compare_hf:
            model = hf_model_for(engine, args)
            result["hf"] = run_hf(model, work, args.hf_batch_size or len(work), engine.device)
            result["speedup_vs_hf"] = (
                result["radixlm"]["output_throughput"] / result["hf"]["output_throughput"]
            )
            print(
                f"HF generate: {result['hf']['output_throughput']:.1f} tok/s; ratio {result['speedup_vs_hf']:.2f}x"
            )
    finally:
        engine.shutdown()
    dev = "cpu" if engine.device.type == "cpu" else device_tag(result["env"])
    write_result(args.out or Path(__file__).parent / "results" / f"offline_throughput_{dev}.json", result)
    return result


if __name__ == "__main__":
    main()
