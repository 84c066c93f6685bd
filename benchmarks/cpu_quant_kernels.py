"""The CPU matmul candidates for GGUF weights, timed on the default model's real layer shapes and
weights (layer 0's Q4_1 projections, the Q8_0 embedding as LM head), each with its relative
error against the float64 matmul with gguf's dequantization. Used by cpu_quant.py --kernels."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

LAYERS = {
    "qkv": "model.layers.0.self_attn.q_proj.weight",
    "o": "model.layers.0.self_attn.o_proj.weight",
    "gate": "model.layers.0.mlp.gate_proj.weight",
    "down": "model.layers.0.mlp.down_proj.weight",
    "lm_head": "model.embed_tokens.weight",
}


def _time(fn: Callable[[], Any], min_s: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def _int4_with(seg: Any, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch's packed int4 path with activations and scales in dtype (bf16 is its fast one)."""
    packed = [getattr(seg, f"packed{i}") for i in range(seg.terms)]
    sz = [getattr(seg, f"scale_zero{i}").to(dtype) for i in range(seg.terms)]

    def run(x: torch.Tensor) -> torch.Tensor:
        xa = x.to(dtype)
        return sum(
            torch.ops.aten._weight_int4pack_mm_for_cpu(xa, p, 32, s) for p, s in zip(packed, sz)
        ).float()

    return run


def candidates(qt: Any) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from radixlm.backend.quant_linear import Int4PackSegment, QuantLinear

    w32 = qt.dequantize()
    w16 = w32.bfloat16()
    layer = QuantLinear([qt], None, torch.device("cpu"), torch.float32)
    seg = Int4PackSegment(qt)
    return {
        "fp32_dense (dequantized at load)": lambda x: F.linear(x, w32),
        "bf16_dense": lambda x: F.linear(x.bfloat16(), w16).float(),
        f"QuantLinear ({type(layer.segments[0]).__name__})": layer,
        "int4pack_bf16": _int4_with(seg, torch.bfloat16),
        "int4pack_fp16": _int4_with(seg, torch.float16),
        "int4pack_fp32": _int4_with(seg, torch.float32),
        "dequantize_per_call + fp32": lambda x: F.linear(x, qt.dequantize()),
    }


def time_candidates(threads: int, rows: tuple[int, ...] = (1, 64)) -> dict[str, Any]:
    from radixlm.backend.loader import iter_weights, resolve_model_dir

    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(None)
    names = set(LAYERS.values())
    weights = {n: w for n, w in iter_weights(model_dir, "gguf", torch.device("cpu")) if n in names}
    out: dict[str, Any] = {}
    for label, name in LAYERS.items():
        qt = weights[name]
        ref_w = qt.dequantize().double()
        shape = f"{label} {qt.qtype} [{qt.rows}x{qt.cols}]"
        out[shape] = {}
        for m in rows:
            x = torch.randn(m, qt.cols, generator=torch.Generator().manual_seed(m))
            ref = F.linear(x.double(), ref_w)
            row = {}
            with torch.inference_mode():
                for cand, fn in candidates(qt).items():
                    err = ((fn(x).double() - ref).norm() / ref.norm()).item()
                    row[cand] = {"us": 1e6 * _time(lambda fn=fn, x=x: fn(x)), "rel_err": err}
            out[shape][f"M={m}"] = row
    return out
