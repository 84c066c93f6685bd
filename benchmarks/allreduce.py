"""All-reduce cost on the GPUs at hand, at the message sizes tensor parallelism sends per decode step
(one [B, hidden] activation after attention and one after the MLP, per layer): NCCL, torch's
symmetric-memory one-shot all-reduce where it runs, and a local two-buffer add (the floor of any
reduction), each launched eagerly (host-bound) and replayed as 64 calls in one CUDA graph (a decode
step's worth). With one GPU the group has one rank, so the figures are each primitive's fixed cost
on this device, not link bandwidth.

    python benchmarks/allreduce.py [--hidden 4096] [--out benchmarks/results/allreduce_h200.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_env import environment  # noqa: E402

ROWS = (1, 8, 64, 256, 1024)
CALLS_PER_STEP = 64  # two all-reduces per layer of a 32-layer model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_us(fn: Callable[[], object], iters: int = 200) -> float:
    """Mean device time of fn in µs (CUDA events around iters calls, after a warm-up)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _graph_us(make_call: Callable[[], None]) -> float:
    """µs per all-reduce when CALLS_PER_STEP of them replay as one captured graph (a decode step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            make_call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_STEP):
            make_call()
    return _time_us(graph.replay, iters=50) / CALLS_PER_STEP


def _symmetric_memory(rows: int, hidden: int) -> dict[str, Any]:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty((rows, hidden), dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        buf.normal_()
        op, name = torch.ops.symm_mem.one_shot_all_reduce, dist.group.WORLD.group_name
        out: dict[str, Any] = {"one_shot_eager_us": _time_us(lambda: op(buf, "sum", name))}
        try:
            out["one_shot_in_graph_us"] = _graph_us(lambda: op(buf, "sum", name))
        except Exception as e:
            out["in_graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return out
    except Exception as e:  # not every build or topology has it: record why
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _one_size(rows: int, hidden: int) -> dict[str, Any]:
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    y = torch.randn_like(x)
    return {
        "rows": rows,
        "bytes": x.numel() * x.element_size(),
        "nccl_eager_us": _time_us(lambda: dist.all_reduce(x)),
        "nccl_in_graph_us": _graph_us(lambda: dist.all_reduce(x)),
        "local_add_eager_us": _time_us(lambda: torch.add(x, y, out=x)),
        "local_add_in_graph_us": _graph_us(lambda: torch.add(x, y, out=x)),
        "symmetric_memory": _symmetric_memory(rows, hidden),
    }


def measure(hidden: int) -> dict[str, Any]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rows_out: list[dict[str, Any]] = []
    try:
        for rows in ROWS:
            rows_out.append(_one_size(rows, hidden))
    finally:
        dist.destroy_process_group()
    return {"world_size": 1, "hidden": hidden, "calls_per_decode_step": CALLS_PER_STEP, "sizes": rows_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device (NCCL)")
    result = {"benchmark": "allreduce", "env": environment(), **measure(args.hidden)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
