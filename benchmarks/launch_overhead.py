"""Host cost of one launch on this machine: a radixlm Triton kernel (fused add + RMSNorm) through
its wrapper, a torch elementwise op and a cuBLAS matmul, each launched many times without a
sync; then the host time of each decoder layer of eager forwards of lone prompts, which tells a
uniform per-layer launch cost from stalls (allocations, a full launch queue). Writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixlm.backend.engine import Engine
from radixlm.backend.models import llama
from radixlm.kernels.rmsnorm import fused_add_rmsnorm


def per_launch_us(fn: Any, n: int) -> float:
    """Median of five bursts of n launches, host microseconds per launch."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def launches(hidden: int, n: int) -> dict[str, float]:
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    r, w = torch.randn_like(x), torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16)
    return {
        "triton_fused_add_rmsnorm_us": per_launch_us(lambda: fused_add_rmsnorm(x, r, w), n),
        "torch_add_us": per_launch_us(lambda: x.add_(0), n),
        "cublas_linear_us": per_launch_us(lambda: F.linear(x, m), n),
    }


def layer_times(eng: Engine, lengths: list[int], reps: int) -> dict[str, Any]:
    """Host ms per decoder layer in eager forwards of lone prompts of each length."""
    seen: list[float] = []
    forward = llama.LlamaDecoderLayer.forward

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            seen.append(1e3 * (time.perf_counter() - t0))

    llama.LlamaDecoderLayer.forward = timed  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        for n in lengths:
            per_rep = []
            for r in range(reps):
                seen.clear()
                eng.flush_cache()
                ids = [100 + (r * 7919 + j * 31) % 30000 for j in range(n)]
                eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
                per_rep.append([round(t, 3) for t in seen])
            flat = sorted(t for rep in per_rep[1:] for t in rep)
            out[str(n)] = {
                "layer_ms_median": statistics.median(flat),
                "layer_ms_p90": flat[int(0.9 * (len(flat) - 1))],
                "layer_ms_max": flat[-1],
                "forward_ms_each": [round(sum(rep), 2) for rep in per_rep],
                "last_rep_layers_ms": per_rep[-1],
            }
            print(
                n, json.dumps({k: v for k, v in out[str(n)].items() if k != "last_rep_layers_ms"}), flush=True
            )
    finally:
        llama.LlamaDecoderLayer.forward = forward  # type: ignore[method-assign]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--launches", type=int, default=2000)
    p.add_argument("--lengths", default="256,512,2048")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    eng = Engine(model_shape="llama-3.1-8b", device="cuda", context_length=16384)
    try:
        res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        res["launch"] = launches(eng.model_config.hidden_size, args.launches)
        print(json.dumps(res["launch"]), flush=True)
        res["layers"] = layer_times(eng, [int(x) for x in args.lengths.split(",")], args.reps)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
