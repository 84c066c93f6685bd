"""GPU-only: overlap scheduling on CUDA with graphs (llama-3.2-1b shape, random bf16 weights).
Overlap on and off give identical greedy tokens (the batches are the same, so the logits are
bitwise equal); and with PyTorch's sync debug mode set to error, a whole run — prefill, graph
decode, sampling, streaming — performs no hidden synchronizing call (the step's event wait is
the one sync the scheduler makes, and it is not one of those)."""

from __future__ import annotations

import gc
import json
import random

import pytest
import torch
from gpu_helpers import mem_fraction

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def gpu_engine():
    from radixlm.backend.engine import Engine

    eng = Engine(
        model_shape="llama-3.2-1b",
        device="cuda",
        mem_fraction_static=mem_fraction(0.2),
        context_length=4096,
        max_running_requests=64,
    )
    assert eng.scheduler.cfg.overlap and eng.runner.graph_runner is not None
    yield eng
    eng.shutdown()
    del eng
    gc.collect()
    torch.cuda.empty_cache()  # later GPU test modules size their KV pools from free memory


def workload(n: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(seed)
    ids = [[rng.randrange(100, 30000) for _ in range(rng.randint(8, 300))] for _ in range(n)]
    params = [
        {"max_new_tokens": rng.choice([1, 5, 17, 40]), "temperature": 0, "ignore_eos": True} for _ in ids
    ]
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


@pytest.mark.parametrize("docs, forks", [(1, 20), (6, 4)])
def test_cascade_graph_decode_agrees_with_plain(docs, forks):
    """Forks of 1024-token documents (float32, so rounding cannot hide a wrong attention): 20 of
    one document decode through the few-groups cascade graph, 4 of each of 6 documents through the
    many-groups one (static plan buffers), and their next-token top-1 log-probabilities equal plain
    graph decode's within 2e-3 at every position up to the first token where the two runs diverge."""
    from radixlm.backend.engine import Engine

    eng = Engine(
        model_shape="llama-3.2-1b",
        device="cuda",
        dtype="float32",
        mem_fraction_static=mem_fraction(0.45),
        context_length=2048,
        max_running_requests=32,
    )
    try:
        rng = random.Random(3)
        documents = [[rng.randrange(100, 30000) for _ in range(1024)] for _ in range(docs)]
        prompts = [d + [rng.randrange(100, 30000) for _ in range(6)] for d in documents for _ in range(forks)]
        sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        kw = {"return_logprob": True, "top_logprobs_num": 1}
        sched, graphs = eng.scheduler, eng.runner.graph_runner
        sched.cfg.cascade_cost = None  # the cascade graph's numbers are under test, not whether it pays
        kind = graphs.cascade[0 if docs <= 4 else 1]
        runs, hits = {}, {}
        for cascade in (True, False):
            sched.cfg.enable_cascade = cascade
            eng.flush_cache()
            eng.generate(input_ids=documents, sampling_params={"max_new_tokens": 1})  # documents cached
            before = kind.hits
            runs[cascade] = eng.generate(input_ids=prompts, sampling_params=sp, **kw)
            hits[cascade] = kind.hits - before
        assert hits[True] >= 5 and hits[False] == 0
        compared = 0
        for a, b in zip(runs[True], runs[False]):
            pairs = zip(a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"])
            for pos, (ta, tb) in enumerate(pairs):
                assert abs(ta[0][0] - tb[0][0]) < 2e-3, (pos, ta, tb)
                compared += 1
                if a["output_ids"][pos] != b["output_ids"][pos]:
                    break
        assert compared >= 40
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def test_constrained_steps_have_no_hidden_sync(gpu_engine):
    """JSON-schema requests (grammar masks filled on the host, applied on the device, sampling
    deferred until the previous step's tokens are accepted) also run without a synchronizing call."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    params = {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)}
    prompts = [list(range(100 + k, 140 + k)) for k in range(8)]
    gpu_engine.generate(input_ids=prompts[:2], sampling_params=params)  # warm
    gpu_engine.flush_cache()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = gpu_engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    assert all(r in ("stop", "length") for r in reasons), [o["meta_info"]["finish_reason"] for o in outs]
