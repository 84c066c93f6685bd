"""One request shape: the engine, the server's request models and the language's gen/run take
their sampling keys, bounds and default max tokens from backend/sampling_params.py."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pydantic
import pytest

import radixlm as sgl
from radixlm.backend.sampling_params import (
    DEFAULT_MAX_NEW_TOKENS,
    FRONTEND_NAMES,
    SAMPLING_KEYS,
    SamplingParams,
    check_values,
)
from radixlm.backend.server.protocol import ChatCompletionRequest, CompletionRequest
from radixlm.backend.server.protocol import SamplingParams as WireSamplingParams
from radixlm.ir import GEN_TO_ENGINE_KEYS
from radixlm.program import Program

ROOT = Path(__file__).resolve().parents[1]
OPENAI_OWN = {"max_new_tokens", "n"}  # OpenAI fields of their own (max_tokens per endpoint, n)


def test_native_wire_model_has_exactly_the_definitions_keys() -> None:
    assert set(WireSamplingParams.model_fields) == set(SAMPLING_KEYS)


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_openai_models_carry_every_key_under_its_openai_name(model: type[pydantic.BaseModel]) -> None:
    expected = {FRONTEND_NAMES.get(k, k) for k in SAMPLING_KEYS if k not in OPENAI_OWN}
    assert expected <= set(model.model_fields)


def test_gen_keys_are_definition_keys() -> None:
    assert set(GEN_TO_ENGINE_KEYS.values()) <= set(SAMPLING_KEYS)
    gen_params = set(inspect.signature(sgl.gen).parameters)
    assert set(GEN_TO_ENGINE_KEYS) <= gen_params


BAD = [
    ("top_p", 1.5, "top_p must be in (0.0, 1.0]"),
    ("repetition_penalty", 3.0, "repetition_penalty must be in [0.01, 2.0]"),
    ("min_p", -0.1, "min_p must be in [0.0, 1.0]"),
    ("top_k", 0, "top_k must be -1"),
    # the sampler divides in float32: inf, or a value float32 cannot hold, would turn masks to NaN
    ("temperature", float("inf"), "temperature must be in [0.0, 3.4028234663852886e+38]"),
    ("temperature", 1e39, "temperature must be in [0.0, 3.4028234663852886e+38]"),
    ("seed", 2**64, "seed must be an integer in [-2**63, 2**64)"),
    ("seed", -(2**63) - 1, "seed must be an integer in [-2**63, 2**64)"),
]


@pytest.mark.parametrize("key,value,reason", BAD)
def test_one_bound_everywhere(key: str, value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        SamplingParams.from_dict({key: value})
    with pytest.raises(pydantic.ValidationError, match=re.escape(reason)):
        WireSamplingParams(**{key: value})
    with pytest.raises(pydantic.ValidationError, match=re.escape(reason)):
        CompletionRequest(prompt="x", **{key: value})
    if key in GEN_TO_ENGINE_KEYS:
        with pytest.raises(ValueError, match=re.escape(reason)):
            sgl.gen("x", **{key: value})


def test_errors_use_the_callers_spelling() -> None:
    with pytest.raises(pydantic.ValidationError, match="min_tokens must be a non-negative integer"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], min_tokens=-1)
    with pytest.raises(pydantic.ValidationError, match="max_new_tokens must be a non-negative integer"):
        WireSamplingParams(max_new_tokens=-1)
    with pytest.raises(ValueError, match="gen: max_tokens must be a non-negative integer"):
        sgl.gen("x", max_tokens=-1)


def test_partial_checks_skip_cross_key_rules() -> None:
    check_values({"min_new_tokens": 500})  # meets a larger max_new_tokens later
    with pytest.raises(ValueError, match="must not exceed"):
        SamplingParams.from_dict({"min_new_tokens": 500})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        check_values({"temprature": 1.0})


def test_default_max_new_tokens_is_one_constant() -> None:
    assert SamplingParams().max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    for method in (Program.run, Program.run_batch):  # None: @function's value, else the default
        assert inspect.signature(method).parameters["max_new_tokens"].default is None
    # No other library file spells the default out again.
    literal = re.compile(r"max_new_tokens\s*(:\s*int\s*)?=\s*128\b|MAX_NEW_TOKENS\s*=\s*128\b")
    hits = [
        str(p.relative_to(ROOT))
        for folder in ("dsl", "backend", "grammars", "kernels")
        for p in (ROOT / folder).rglob("*.py")
        if literal.search(p.read_text()) and p.name != "sampling_params.py"
    ]
    assert hits == []
