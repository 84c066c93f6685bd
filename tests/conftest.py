"""Shared fixtures: the default model (converted once per machine), a session-wide engine on
it, and the HF transformers reference model loaded from the same converted folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    return model.eval()
