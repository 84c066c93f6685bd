"""GPU (skipped without CUDA): Engine.shutdown() frees the device memory the engine owns
(weights, KV pool, CUDA graphs) while a ProgramState and the default backend still reference it,
so a second engine sized to most of the GPU starts in the same process."""

from __future__ import annotations

import gc

import pytest
import torch

import radixlm as sgl
from radixlm.backend.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTS = {"model_shape": "llama-3.2-1b", "device": "cuda", "mem_fraction_static": 0.8}
NEAR_ZERO = 256 << 20  # cuBLAS workspaces and allocator rounding may stay; weights + KV are GBs


@sgl.function
def ask(s):
    s += "Question: is water wet?\nAnswer:"
    s += sgl.select("a", choices=[" yes", " no"])
    s += sgl.gen("why", max_tokens=4)


def test_shutdown_releases_memory_while_referenced() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    rt = sgl.Runtime(**OPTS)
    sgl.set_default_backend(rt)
    try:
        state = ask.run()  # a live ProgramState: it references the backend, hence the engine
        assert state["a"] in (" yes", " no")
        engine = rt.engine
        held = torch.cuda.memory_allocated() - base
        assert held > 1 << 30, f"the engine holds only {held} bytes?"
        engine.shutdown()
        assert sgl.get_default_backend() is rt  # still referenced: shutdown alone must free
        freed_to = torch.cuda.memory_allocated() - base
        assert freed_to < NEAR_ZERO, f"{freed_to} bytes still allocated after shutdown"
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate("x", {"max_new_tokens": 1})
        second = Engine(**OPTS)  # would fail with 'no GPU memory left for the KV pool' otherwise
        try:
            out = second.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert out["meta_info"]["completion_tokens"] == 4
        finally:
            second.shutdown()
        assert torch.cuda.memory_allocated() - base < NEAR_ZERO
        assert state["a"] in (" yes", " no")  # the state stays readable after its engine is gone
    finally:
        sgl.set_default_backend(None)
