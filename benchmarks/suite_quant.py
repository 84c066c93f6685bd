"""The suite's quantization rows: engines on the suite's model shape with weights quantized at
load ("q4_0", "fp8") and with an fp8 KV cache (on the CPU: the default model's fp32 export), each running the default engine's own workload
(batch-1 decode, the b128 batch, the mixed requests) so suite_report divides by the bf16 figures
of the same suite run."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixlm.kernels.quant_gemv_configs import QuantMatmulConfig

# (label, Engine keyword arguments, the workloads it runs)
VARIANTS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("q4_0", {"quantization": "q4_0"}, ("decode_b1", "b128")),
    ("fp8", {"quantization": "fp8"}, ("decode_b1", "b128")),
    ("kv_fp8", {"kv_cache_dtype": "fp8_e4m3"}, ("b128", "mixed")),
]
# run only where SUITE_QUANT_VARIANTS names them: a variant with another kernel kind for one
# 16-bit row of every format, beside the default's own row of the same run
ONE_ROW_EXPERIMENTS: dict[str, tuple[str, str]] = {
    "q4_0_int8x": ("q4_0", "int8x"),
    "q4_0_dp4a": ("q4_0", "dp4a"),
    "q4_0_stream": ("q4_0", "stream"),
}


def one_row_config(kind: str, spec: str) -> QuantMatmulConfig:
    """kind's config from "rows:block_k:warps[:stages]", for kind "stream"
    "rows:block_k:warps:stages:programs_per_sm" (the forms quant_gpu.py's --configs, SUITE_INT8X
    and SUITE_STREAM take)."""
    from radixlm.kernels.quant_gemv_configs import QuantMatmulConfig

    nums = [int(v) for v in spec.split(":")]
    if kind == "stream":
        if len(nums) != 5:
            raise ValueError(f"a stream config is rows:block_k:warps:stages:programs_per_sm, got {spec!r}")
        rows, block_k, warps, stages, per_sm = nums
        return QuantMatmulConfig(kind, rows, block_k, warps, num_stages=stages, programs_per_sm=per_sm)
    if len(nums) not in (3, 4):
        raise ValueError(f"a one-row config is rows:block_k:warps[:stages], got {spec!r}")
    rows, block_k, warps, *stages = nums
    return QuantMatmulConfig(kind, rows, block_k, warps, num_stages=stages[0] if stages else 1)


def int8x_configs(spec: str | None) -> tuple[QuantMatmulConfig, QuantMatmulConfig]:
    """int8x's configs for rows of K below and from LONG_K: quant_gemv_configs' own, or those spec
    names ("rows:block_k:warps[:stages]/rows:block_k:warps[:stages]", the form SUITE_INT8X takes
    and benchmarks/quant_gpu.py prints for its fastest)."""
    from radixlm.kernels import quant_gemv_configs as qc

    if not spec:
        return qc.INT8X, qc.INT8X_LONG_K
    parts = spec.split("/")
    if len(parts) != 2 or any(len(p.split(":")) not in (3, 4) for p in parts):
        raise ValueError(
            f"SUITE_INT8X takes rows:block_k:warps[:stages]/rows:block_k:warps[:stages], got {spec!r}"
        )
    return one_row_config("int8x", parts[0]), one_row_config("int8x", parts[1])


@contextmanager
def one_row_kind(kind: str | None) -> Iterator[None]:
    """quant_matmul's one-row choice for every format and weight while inside: "int8x" sets
    int8x's configs (SUITE_INT8X's where set), "dp4a" the dp4a kind's (neither keeps
    ONE_ROW_LARGE's choice for the large weights); "stream" takes SUITE_STREAM, "short/long/rest":
    the stream configs for the large Q4 weights of K below LONG_K (gate_up), of longer K (down)
    and the Q4 formats' other one-row matmuls, "-" keeping the default's."""
    from radixlm.kernels import quant_gemv_configs as qc

    if kind not in (None, "int8x", "dp4a", "stream"):
        raise ValueError(f"no one-row experiment kind {kind!r}")
    tables = (qc.ONE_ROW, qc.LONG_K_CONFIG, qc.ONE_ROW_LARGE)
    saved = [dict(t) for t in tables]
    if kind == "int8x":
        short, long = int8x_configs(os.environ.get("SUITE_INT8X"))
        qc.ONE_ROW.update(dict.fromkeys(qc.ONE_ROW, short))
        qc.LONG_K_CONFIG[short] = long
    elif kind == "dp4a":
        qc.ONE_ROW.update(dict.fromkeys(qc.ONE_ROW, qc.DP4A))
    if kind in ("int8x", "dp4a"):
        qc.ONE_ROW_LARGE.clear()
    if kind == "stream":
        set_stream_configs(os.environ.get("SUITE_STREAM", "1:4096:1:2:21/-/-"))
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)


def set_stream_configs(spec: str) -> None:
    """quant_gemv_configs' tables as SUITE_STREAM's "short/long/rest" says (see one_row_kind)."""
    from radixlm.kernels import quant_gemv_configs as qc

    parts = spec.split("/")
    if len(parts) != 3:
        raise ValueError(f"SUITE_STREAM is short/long/rest ('-' keeps the default's), got {spec!r}")
    short, long, rest = (None if p == "-" else one_row_config("stream", p) for p in parts)
    large = dict(qc.ONE_ROW_LARGE)
    if short is not None:
        qc.ONE_ROW_LARGE.update(dict.fromkeys(large, short))
    for q, before in large.items():  # down: its own config, else the one it had
        chosen = qc.ONE_ROW_LARGE[q]
        qc.LONG_K_CONFIG[chosen] = long or qc.LONG_K_CONFIG.get(before, before)
    if rest is not None:  # the Q4 formats' smaller weights (not Q8_0's lm_head)
        qc.ONE_ROW.update(dict.fromkeys(large, rest))


def one_row_labels() -> dict[str, dict[str, str]]:
    """The one-row choice in force (quant_gemv_configs' tables), as config labels, for the record."""
    from radixlm.kernels import quant_gemv_configs as qc

    return {
        "one_row": {fmt: c.label() for fmt, c in qc.ONE_ROW.items()},
        "one_row_large": {fmt: c.label() for fmt, c in qc.ONE_ROW_LARGE.items()},
        "long_k": {a.label(): b.label() for a, b in qc.LONG_K_CONFIG.items()},
    }


def variants(only: str | None) -> list[tuple[str, dict[str, Any], tuple[str, ...], str | None]]:
    """The variants to run (all of VARIANTS, or those `only` names, a comma list, experiments
    included), each with its one-row kernel kind (None: the default)."""
    names = only.split(",") if only else None
    out: list[tuple[str, dict[str, Any], tuple[str, ...], str | None]] = [
        (label, kwargs, workloads, None)
        for label, kwargs, workloads in VARIANTS
        if names is None or label in names
    ]
    by_label = {label: (kwargs, workloads) for label, kwargs, workloads in VARIANTS}
    for label, (base, kind) in ONE_ROW_EXPERIMENTS.items():
        if names is not None and label in names:
            kwargs, _ = by_label[base]
            out.append((label, kwargs, ("decode_b1",), kind))
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step streams: parameters, buffers and the GPU block arrays
    of quantized layers (held outside both)."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for mod in model.modules():
        blocks = getattr(mod, "blocks", None)
        if blocks is not None and hasattr(blocks, "qs"):
            tensors += [t for t in (blocks.qs, blocks.d, blocks.m) if t is not None]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def quant_rows(sizes: dict[str, Any], engine_kwargs: dict[str, Any], partial: Callable[[dict], None]) -> dict:
    import suite_workloads as w

    runs: dict[str, Callable[[Any], dict[str, Any]]] = {
        "decode_b1": lambda e: w.decode_b1(e, **sizes["decode_b1"]),
        "b128": lambda e: w.batch_throughput(e, **sizes["b128"]),
        "mixed": lambda e: w.batch_throughput(e, **sizes["mixed"]),
    }
    if "model_shape" not in engine_kwargs and "model_path" not in engine_kwargs:
        # the default model is a GGUF file, already quantized: its fp32 export is the float model
        from pathlib import Path

        from radixlm.backend.gguf_loader import export_hf_folder
        from radixlm.backend.loader import default_model_path

        engine_kwargs = {**engine_kwargs, "model_path": str(export_hf_folder(Path(default_model_path())))}
    out: dict[str, Any] = {}
    for label, kwargs, workloads, kind in variants(os.environ.get("SUITE_QUANT_VARIANTS")):
        workloads = tuple(sizes.get("quant_workloads", {}).get(label, workloads))
        res: dict[str, Any] = {}
        out[label] = res
        with one_row_kind(kind):
            res["one_row_configs"] = one_row_labels()
            run_variant(res, label, engine_kwargs, kwargs, workloads, runs, partial, out)
    return out


def run_variant(
    res: dict[str, Any],
    label: str,
    engine_kwargs: dict[str, Any],
    kwargs: dict[str, Any],
    workloads: tuple[str, ...],
    runs: dict[str, Callable[[Any], dict[str, Any]]],
    partial: Callable[[dict], None],
    out: dict[str, Any],
) -> None:
    """One variant's engine and workloads into res; a start failure is recorded, not raised."""
    import suite_workloads as w

    from radixlm.backend.engine import Engine

    try:
        t0 = time.perf_counter()
        engine = Engine(**engine_kwargs, **kwargs)
    except Exception as e:
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}"
        partial(out)
        return
    res["engine_start_s"] = time.perf_counter() - t0
    res["kv_slots"] = engine.runner.allocator.size
    model = engine.runner.model
    res["weight_bytes"] = weight_bytes(model)
    # what a decode step reads: everything but the embedding table (one row per token)
    res["streamed_bytes"] = res["weight_bytes"] - weight_bytes(model.model.embed_tokens)
    try:
        for name in workloads:
            w.run_step(res, name, lambda name=name, engine=engine: runs[name](engine), f"quant {label}")
            partial(out)
        b1 = res.get("decode_b1", {})
        if b1.get("copy_bytes_per_s"):  # decode_b1's own roofline counts parameters only
            b1["roofline_tok_s"] = b1["copy_bytes_per_s"] / res["streamed_bytes"]
            b1["fraction_of_roofline"] = b1["overlap_on"]["decode_tok_s"] / b1["roofline_tok_s"]
    finally:
        engine.shutdown()
