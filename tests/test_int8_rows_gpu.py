"""The default GGUF model on the GPU, kept as GGUF blocks, with its one-row matmuls on kind
"int8x" (x rounded to int8 by the norm or SiLU-and-mul that writes it) against the same engine on
the default kind: both round x alike, so greedy decoding (CUDA graphs on) must agree at nearly
every position."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_int8x_engine_decodes_as_the_default_kind() -> None:
    from cpu_quant_quality import PROMPTS, agreement, greedy_reference
    from gpu_helpers import mem_fraction, skip_without_default_weights
    from suite_quant import one_row_kind

    from radixlm.backend.engine import Engine
    from radixlm.backend.models.llama import reads_int8

    skip_without_default_weights()
    prompts = PROMPTS[:4]
    ref = Engine(device="cuda", dtype="bfloat16", quantization="gguf", mem_fraction_static=mem_fraction(0.2))
    try:
        seqs = greedy_reference(ref, prompts, 32)
        with one_row_kind("int8x"):
            eng = Engine(
                device="cuda", dtype="bfloat16", quantization="gguf", mem_fraction_static=mem_fraction(0.2)
            )
            try:
                layer = eng.runner.model.model.layers[0]
                row = torch.zeros(1, layer.mlp.gate_up_proj.in_features, dtype=torch.bfloat16, device="cuda")
                assert reads_int8(layer.mlp.gate_up_proj, row)  # the fused rounding is on
                got = greedy_reference(eng, prompts, 32)
                res = agreement(eng, ref, seqs, [len(ref.tokenizer.encode(p)) for p in prompts], True)
            finally:
                eng.shutdown()
    finally:
        ref.shutdown()
    assert sum(a == b for a, b in zip(got, seqs)) >= 3, (got, seqs)  # free-running: a tie may flip
    assert res["greedy_agreement"] >= 0.97, res
