"""`not` rewritten as a positive schema (grammars/schema_not.py) is checked against jsonschema: for each
negated schema, every probe value is valid against the rewrite exactly when it fails the original;
cases that cannot be stated exactly stay refusals (None), and the compiled grammar agrees too."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend
from radixlm.grammars.schema_not import negate

PROBES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    -2,
    2.5,
    -2.0,
    7,
    300,
    301,
    299.5,
    "",
    "a",
    "ab",
    "abc",
    "abcd",
    "b",
    "1",
    "3",
    "foo",
    "fo",
    "fooo",
    "ä",
    'q"',
    [],
    [1],
    [1, 2],
    [1, 2, 3],
    ["a"],
    [False],
    [[False]],
    [[True]],
    [[False, False]],
    [[False], 1],
    {},
    {"a": 1},
    {"a": False},
    {"foo": "x"},
    {"foo": 1},
    {"bar": 2},
    {"foo": "x", "bar": 2},
    {"baz": None, "foo": "y"},
]

EXACT = [
    {"type": "string"},
    {"type": ["number", "string"]},
    {"type": "null", "title": "annotations are ignored"},
    {"enum": ["1", "3"]},
    {"enum": ["foo", "fo", "", "ä", 'q"']},
    {"enum": [6, None]},
    {"const": -2.0},
    {"enum": [1, 3, 2.5, "a", True]},
    {"const": False},
    {"minimum": 2},
    {"maximum": 300},
    {"exclusiveMinimum": 2, "type": "number"},
    {"exclusiveMaximum": 3},
    {"maxLength": 2},
    {"minLength": 2, "type": "string"},
    {"minItems": 2},
    {"maxItems": 1},
    {"maxProperties": 1},
    {"minProperties": 1},
    {"required": ["foo", "bar"]},
    {"properties": {"foo": {"type": "string"}, "bar": {"minimum": 3}}},
    {"allOf": [{"required": ["foo"]}, {"properties": {"foo": {"type": "string"}}}]},
    {"anyOf": [{"type": "string"}, {"minimum": 2}]},
    {"anyOf": [{"maxLength": 2}, {"minLength": 4}], "type": "string"},
    {"not": {"type": "array"}},
    {"$ref": "#/$defs/s"},
    {},
    False,
    {"enum": [[False]]},  # an array value of one item: its negation is spelled out
]
UNKNOWN = [
    {"type": "integer"},
    {"exclusiveMinimum": 2, "type": "integer"},
    {"multipleOf": 2},
    {"pattern": "^a"},
    {"items": {"type": "integer"}},
    {"additionalProperties": False, "properties": {"a": {}}},
    {"oneOf": [{"type": "string"}, {"minLength": 1}]},
]


def _check(schema: dict):
    """Positive rewrite for {"not": schema} inside a root holding $defs."""
    root = {"$defs": {"s": {"type": "string", "maxLength": 2}}, "not": schema}
    return root, negate(schema, root)


@pytest.mark.parametrize("schema", EXACT, ids=lambda s: json.dumps(s)[:40])
def test_negation_is_exact(schema) -> None:
    root, neg = _check(schema)
    assert neg is not None
    original = jsonschema.Draft202012Validator(root)
    rewritten = jsonschema.Draft202012Validator({"$defs": root["$defs"], "allOf": [neg]})
    for value in PROBES:
        assert rewritten.is_valid(value) == original.is_valid(value), value


@pytest.mark.parametrize("schema", UNKNOWN, ids=lambda s: json.dumps(s)[:40])
def test_unknown_negations_stay_refused(schema) -> None:
    assert _check(schema)[1] is None


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152, use_disk_cache=False)


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {"enum": ["1", "3"]}, "type": "string"},
        {"type": "number", "not": {"enum": [1, 2.5]}},
        {"type": "object", "not": {"required": ["foo", "bar"]}},
        {"type": "object", "properties": {"foo": {"not": {"const": "x"}}}},
    ],
)
def test_grammar_enforces_the_negation(backend: GrammarBackend, schema: dict) -> None:
    g = backend.compile("json_schema", schema)  # strict: the `not` is enforced, not dropped
    validator = jsonschema.Draft202012Validator(schema)
    for value in PROBES:
        text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
        m = g.new_matcher()
        ok = m.accept_string(text) and m.accept_token(backend.stop_token_ids[0]) and m.is_terminated()
        assert ok == validator.is_valid(value), value
