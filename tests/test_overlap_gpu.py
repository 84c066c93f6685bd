"""GPU-only: overlap scheduling on CUDA with graphs (llama-3.2-1b shape, random bf16 weights).
Overlap on and off give identical greedy tokens (the batches are the same, so the logits are
bitwise equal); and with PyTorch's sync debug mode set to error, a whole run — prefill, graph
decode, sampling, streaming — performs no hidden synchronizing call (the step's event wait is
the one sync the scheduler makes, and it is not one of those)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_engine():
    from radixlm.backend.engine import Engine

    eng = Engine(model_shape="llama-3.2-1b", device="cuda", mem_fraction_static=0.2, context_length=4096,
                 max_running_requests=64)
    assert eng.scheduler.cfg.overlap and eng.runner.graph_runner is not None
    yield eng
    eng.shutdown()
    del eng
    gc.collect()
    torch.cuda.empty_cache()  # later GPU test modules size their KV pools from free memory


def workload(n: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(seed)
    ids = [[rng.randrange(100, 30000) for _ in range(rng.randint(8, 300))] for _ in range(n)]
    params = [{"max_new_tokens": rng.choice([1, 5, 17, 40]), "temperature": 0, "ignore_eos": True} for _ in ids]
    return ids, params


def test_overlap_on_off_identical(gpu_engine):
    ids, params = workload(24, 0)
    sched = gpu_engine.scheduler
    runs = {}
    for overlap in (True, False):
        sched.cfg.overlap = overlap  # the loop is idle between calls
        gpu_engine.flush_cache()
        runs[overlap] = [o["output_ids"] for o in gpu_engine.generate(input_ids=ids, sampling_params=params)]
    sched.cfg.overlap = True
    assert runs[True] == runs[False]
    assert sum(gpu_engine.runner.graph_runner.bucket_hits.values()) > 0


def test_no_hidden_sync(gpu_engine):
    ids, params = workload(8, 1)
    gpu_engine.generate(input_ids=ids[:2], sampling_params=params[:2])  # warm: every kernel compiled
    gpu_engine.flush_cache()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = gpu_engine.generate(input_ids=ids, sampling_params=params)
        streamed = list(gpu_engine.generate(input_ids=ids[0], sampling_params=params[0], stream=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reasons = [o["meta_info"]["finish_reason"] for o in outs] + [streamed[-1]["meta_info"]["finish_reason"]]
    assert all(r["type"] == "length" for r in reasons), reasons
