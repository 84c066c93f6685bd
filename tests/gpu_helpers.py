"""GPU test helpers: memory fractions on top of what the process already holds, so one test's
engine (a module fixture still alive, a leak under investigation) cannot starve the next; the
sync-free and graph-replay check of a kernel call."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch


def mem_fraction(extra: float) -> float:
    """mem_fraction_static that leaves `extra` of the GPU to a new engine after what is in use now."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return min(0.95, extra + (total - free) / total)


def assert_sync_free_graph_replay(run: Callable[[], torch.Tensor], q: torch.Tensor) -> None:
    """run() (reading q) makes no host sync, captures into a CUDA graph, and the graph replayed on
    new values of q gives exactly what an eager call gives."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
