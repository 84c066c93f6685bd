"""Shared fixtures: the default model (its tokenizer converted once per machine), a session-wide
engine on it with the weights dequantized to fp32, and the HF transformers reference on the same
fp32 weights (exported once per machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import radixlm  # noqa: F401 - first: routes the name `kernels` (radixlm/_hub_kernels.py) before tests import transformers

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Engines here (and servers the tests start) dequantize GGUF weights unless a test asks for
# quantization="gguf": the exact invariants (greedy output alone == batched == chunked ==
# HF's) hold in fp32; with GGUF blocks kept, the bf16 activations of the packed matmul turn
# the attention's last-bit differences between batch shapes into rare greedy flips.
# tests/test_quant_engine.py checks the quantized default against this fp32 reference.
os.environ.setdefault("RADIXLM_QUANTIZATION", "dequantize")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from radixlm.backend.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def engine():
    from radixlm.backend.engine import Engine

    eng = Engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    from radixlm.backend.gguf_loader import export_hf_folder
    from radixlm.backend.loader import default_model_path

    folder = export_hf_folder(Path(default_model_path()))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()
