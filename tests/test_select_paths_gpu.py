"""GPU (skipped without CUDA): `select` and prompt logprobs agree with the radix cache on and off,
overlap scheduling on and off, with and without forks, batch 1 and 16, on the llama-3.1-8b shape
(random fp32 weights, where each prompt forward is long enough to expose unsynchronised reads)."""

from __future__ import annotations

import pytest
import torch
from test_select_paths import CASES, assert_same, outcome

import radixlm as sgl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = {
    "model_shape": "llama-3.1-8b",
    "device": "cuda",
    "dtype": "float32",
    "cuda_graph_max_bs": 16,
    "max_total_tokens": 65536,
}
PATHS = [(True, True), (False, True), (False, False)]  # (radix cache, overlap); overlap is CUDA's default


def test_select_agrees_with_radix_cache_on_and_off() -> None:
    results = {}
    for radix, overlap in PATHS:  # one engine at a time: shutdown frees its weights for the next
        with sgl.Runtime(disable_radix_cache=not radix, overlap_schedule=overlap, **SHAPE) as rt:
            results[(radix, overlap)] = {(p.__name__, b): outcome(p, rt, b) for p, b in CASES}
    reference = results[PATHS[0]]
    for path in PATHS[1:]:
        for key, ref in reference.items():
            assert_same(results[path][key], ref, 2e-3)
