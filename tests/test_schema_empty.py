"""Schemas with no finite instance (grammars/schema_empty.py): each case's verdict is checked against
jsonschema itself, a satisfiable case by a witness it accepts, an empty one by jsonschema refusing
every candidate value up to four levels deep; the JSON-schema compiler refuses the empty ones
with a reason, where the grammar engines had compiled a grammar that refuses every document."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend
from radixlm.grammars.schema_empty import empty_reason

D7 = "http://json-schema.org/draft-07/schema#"
NODE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
# (schema, a value it accepts, or None when no finite value does)
CASES: list[tuple[Any, Any]] = [
    ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, None),
    ({"$defs": {"n": {**NODE, "required": []}}, "$ref": "#/$defs/n"}, {"c": {}}),
    (
        {"$defs": {"n": {**NODE, "properties": {"c": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"},
        {"c": {"c": None}},
    ),
    ({"$defs": {"n": {**NODE, "type": ["object", "null"]}}, "$ref": "#/$defs/n"}, {"c": None}),
    ({"definitions": {"t": {"type": "array", "minItems": 1, "items": {"$ref": "#/definitions/t"}}}, "$ref": "#/definitions/t"}, None),
    ({"definitions": {"t": {"type": "array", "items": {"$ref": "#/definitions/t"}}}, "$ref": "#/definitions/t"}, [[]]),
    ({"$schema": D7, "type": "array", "minItems": 2, "items": [{"type": "integer"}], "additionalItems": False}, None),
    ({"$schema": D7, "type": "array", "minItems": 1, "items": [{"type": "integer"}], "additionalItems": False}, [1]),
    ({"type": "array", "minItems": 1, "prefixItems": [{"type": "integer"}], "items": False}, [1]),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, None),
    ({"type": "object", "properties": {"a": False}}, {}),
    ({"allOf": [{"type": "object"}, False]}, None),
    ({"oneOf": [False, {"anyOf": [False]}]}, None),
    ({"anyOf": [False, {"type": "string"}]}, "s"),
    (
        {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                   "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
         "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}},
        {},
    ),  # mutually recursive and empty, but only an optional property reaches them
    ({"$ref": "https://example.com/elsewhere.json"}, "anything"),
]  # fmt: skip


def _values(depth: int) -> list[Any]:
    """Small JSON values of every type, containers nesting up to depth."""
    flat: list[Any] = [None, True, 0, 1, 1.5, "", "s"]
    if depth == 0:
        return flat
    inner = _values(depth - 1)[-12:]
    return flat + [[], {}] + [[v] for v in inner] + [{k: v} for k, v in itertools.product("abc", inner)]


@pytest.mark.parametrize("schema,witness", CASES)
def test_empty_verdicts_agree_with_jsonschema(schema: Any, witness: Any) -> None:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    if witness is None:
        assert empty_reason(schema) is not None
        candidates = _values(4) + [{"c": {"c": {"c": {}}}}, [[[[]]]], [1, 2]]
        assert not any(validator.is_valid(v) for v in candidates)
    else:
        assert empty_reason(schema) is None
        if not str(schema.get("$ref", "#")).startswith("https:"):
            assert validator.is_valid(witness)


def test_the_reason_names_the_empty_definition() -> None:
    assert "#/$defs/n" in (empty_reason(CASES[0][0]) or "")


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152)


def test_compiler_refuses_a_schema_only_infinite_values_satisfy(backend: GrammarBackend) -> None:
    with pytest.raises(ValueError, match=r"matches nothing.*#/\$defs/n"):
        backend.compile("json_schema", json.dumps(CASES[0][0]), "auto", True)
    compiled = backend.compile("json_schema", json.dumps(CASES[2][0]), "auto", True)
    m = compiled.new_matcher()
    assert m.accept_string('{"c": {"c": null}}') and m.accept_token(backend.tokenizer.eos_token_id)
