"""grammars/schema_policy.generation_policy: what generation writes is narrower than what the schema
accepts. Objects that list their properties and say nothing about others are closed (as xgrammar's
strict mode, SGLang's and vLLM's default, writes them); explicit openness, bare objects and objects
combined with others stay open; integers get at most 16 digits. Acceptance stays the schema's."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from grammar_helpers import allowed_ids
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend
from radixlm.grammars.schema_policy import MAX_DIGITS_INT, generation_policy

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    tok = default_tokenizer()
    return GrammarBackend(tok, len(tok), stop_token_ids=[tok.eos_token_id])


def test_listed_properties_are_closed_and_nested_ones_too() -> None:
    schema = {"type": "object", "properties": {"owner": PERSON, "tags": {"type": "array", "items": PERSON}}}
    out = generation_policy(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["owner"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["owner"]["properties"]["age"]["maximum"] == MAX_DIGITS_INT
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


@pytest.mark.parametrize(
    "schema",
    [
        {**PERSON, "additionalProperties": True},
        {**PERSON, "additionalProperties": {"type": "string"}},
        {**PERSON, "patternProperties": {"^x-": {}}},
        {"type": "object"},
        {**PERSON, "required": ["name", "email"]},  # a required name it does not list
    ],
)
def test_objects_that_say_something_about_others_stay_open(schema: dict[str, Any]) -> None:
    assert generation_policy(schema).get("additionalProperties") == schema.get("additionalProperties")


def test_combined_objects_stay_open() -> None:
    schema = {
        "anyOf": [PERSON, {"$ref": "#/$defs/pet"}],
        "$defs": {"pet": {"type": "object", "properties": {"species": {"type": "string"}}}},
    }
    out = generation_policy(schema)
    assert "additionalProperties" not in out["anyOf"][0]
    assert "additionalProperties" not in out["$defs"]["pet"]


def test_generation_leaves_out_undeclared_keys_and_acceptance_keeps_them(backend: GrammarBackend) -> None:
    compiled = backend.compile("json_schema", json.dumps(PERSON))
    stop = backend.stop_token_ids[0]
    walk = compiled.new_matcher()
    assert walk.accept_string('{"name": "a", "age": 3')
    bitmask = torch.zeros((1, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    walk.fill_next_token_bitmask(bitmask, 0)
    allowed = {backend.vocab.token_bytes[i] for i in allowed_ids(bitmask[0], backend.vocab_size)}
    assert b"}" in allowed and not any(t.startswith(b",") for t in allowed)  # age is the last key
    forced = compiled.new_matcher()
    assert forced.accept_string('{"name": "a", "age": 3, "team": "x"}')
    assert forced.accept_token(stop) and forced.is_terminated()
