"""GPU-only: the whole CUDA path — fused projections, fused rope + KV store, Triton attention,
CUDA-graph decode and overlap scheduling — against HF transformers on tiny random Llama 3 /
Qwen3 checkpoints, in float32 on the same GPU: identical greedy tokens and close per-token
logprobs (HF's log-softmax of its own logits at each generated position)."""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_helpers import mem_fraction
from test_engine_hf_parity import _tiny_model

from radixlm.backend.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hf_logprobs(model, ids: list[int], out: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids + out], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0].tolist()


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_tiny_models_match_hf_on_gpu(kind, tmp_path, default_model_dir):
    model, path = _tiny_model(kind, tmp_path, default_model_dir)
    model = model.to("cuda")
    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=rng).tolist() for n in (5, 17, 40, 90)]
    eng = Engine(
        model_path=str(path),
        device="cuda",
        dtype="float32",
        max_total_tokens=4096,
        mem_fraction_static=mem_fraction(0.3),
        max_running_requests=16,
    )
    try:
        assert eng.scheduler.cfg.overlap and eng.runner.graph_runner is not None
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        outs = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert sum(eng.runner.graph_runner.bucket_hits.values()) > 0
        for ids, o in zip(prompts, outs):
            with torch.no_grad():
                ref = model.generate(
                    torch.tensor([ids], device="cuda"),
                    max_new_tokens=24,
                    do_sample=False,
                    min_new_tokens=24,
                    pad_token_id=0,
                    eos_token_id=None,
                )[0, len(ids) :].tolist()
            assert o["output_ids"] == ref
            ours = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(ours, hf_logprobs(model, ids, ref))) < 2e-3
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
