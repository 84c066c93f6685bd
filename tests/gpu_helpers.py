"""GPU test helpers: memory fractions on top of what the process already holds, so one test's
engine (a module fixture still alive, a leak under investigation) cannot starve the next; the
sync-free and graph-replay check of a kernel call; a skip, with its reason, for tests of the
default model where only its tokenizer is on the machine (the GPU machine gets the weights only
when they are carried)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
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


def skip_without_default_weights() -> None:
    """Skip the calling test (or fixture) where the default model is a folder without weights."""
    from radixlm.backend.loader import default_model_path

    path = Path(default_model_path())
    if path.is_dir() and not any(path.glob("*.safetensors")):
        pytest.skip(
            f"the default model at {path} has no weights here (carry its GGUF: "
            "GGUF=1 bash benchmarks/h200/prepare.sh)"
        )
