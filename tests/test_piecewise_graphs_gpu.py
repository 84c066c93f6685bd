"""GPU checks of piecewise CUDA graphs for extend steps (skipped without CUDA): with real capture,
a fresh prompt, chunks behind cached prefixes and a mixed step (16 decode rows through decode
attention, then a chunk) give the eager forward's logits and KV, also into an fp8 pool, and padding
rows write no KV slot; through the Engine, prompts of three buckets give the greedy tokens of an
engine without the pieces, and no kernel compiles on the request path."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import mem_fraction
from test_cuda_graph_gpu import _tiny_cuda_runner
from test_piecewise_graphs import piecewise_vs_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "steps",
    [
        [(0, 37)],
        [(12, 9), (0, 130), (5, 1)],
        [(30, 1)] * 16 + [(20, 40)],  # at MIXED_DECODE_MIN_ROWS: the decode rows take decode attention
    ],
)
def test_a_step_through_captured_pieces_matches_the_eager_forward(steps):
    from radixlm.backend.cuda_graph_runner import CudaGraphCapture
    from radixlm.backend.piecewise_graphs import PiecewiseGraphs

    runner = _tiny_cuda_runner(torch.float32)
    pieces = PiecewiseGraphs(runner.graph_target(), runner.model, 256, CudaGraphCapture(runner.device))
    assert pieces.capture_all()
    got, eager, bucket = piecewise_vs_eager(runner, pieces, steps)
    rel = ((got - eager).norm() / eager.norm()).item()
    print(f"piecewise vs eager, {len(steps)} items in bucket {bucket}: rel err {rel:.2e}")
    assert rel < 1e-4 and bucket == min(s for s in pieces.sizes if s >= sum(n for _, n in steps))


def test_an_fp8_pool_step_through_captured_pieces_matches_the_eager_forward():
    from test_cuda_graph import TINY

    from radixlm.backend.cuda_graph_runner import CudaGraphCapture
    from radixlm.backend.model_config import ModelConfig
    from radixlm.backend.model_runner import ModelRunner
    from radixlm.backend.piecewise_graphs import PiecewiseGraphs

    cfg = ModelConfig.from_hf_dict({**TINY, "hidden_size": 128, "max_position_embeddings": 1024})
    runner = ModelRunner(
        cfg,
        None,
        torch.device("cuda"),
        torch.bfloat16,
        2048,
        0.95,
        16,
        random_weights=True,
        disable_cuda_graph=True,
        kv_cache_dtype="fp8_e4m3",
    )
    pieces = PiecewiseGraphs(runner.graph_target(), runner.model, 256, CudaGraphCapture(runner.device))
    assert pieces.capture_all()
    # bf16 matmuls of other row counts may round a value across an fp8 step (1/8 relative)
    got, eager, _ = piecewise_vs_eager(runner, pieces, [(30, 1)] * 16 + [(20, 40)], kv_tolerance=0.13)
    rel = ((got - eager).norm() / eager.norm()).item()
    print(f"piecewise vs eager, fp8 pool, bf16 model: rel err {rel:.2e}")
    assert rel < 2e-2 and bool((got.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9)


def test_engine_greedy_tokens_with_and_without_pieces():
    from radixlm.backend.engine import Engine
    from radixlm.kernels import compiled_kernel_count

    prompts = [[(7 * i + 3 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((40, 150, 700))]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs, hits = [], {}
    for max_tokens in (None, 0):
        eng = Engine(
            model_shape="smollm2-tiny",
            device="cuda",
            dtype="float32",
            mem_fraction_static=mem_fraction(0.2),
            piecewise_cuda_graph_max_tokens=max_tokens,
            cuda_graph_max_bs=8,  # no prompt fits the decode graphs as decode rows
            disable_radix_cache=True,
        )
        try:
            compiled = compiled_kernel_count()
            outs.append([eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts])
            assert compiled_kernel_count() == compiled  # nothing compiles on the request path
            pieces = eng.runner.piecewise
            hits[max_tokens] = sum(pieces.bucket_hits.values()) if pieces is not None else 0
        finally:
            eng.shutdown()
    assert hits[0] == 0 and hits[None] >= 3  # each prompt's extend through the pieces
    assert outs[0] == outs[1]
