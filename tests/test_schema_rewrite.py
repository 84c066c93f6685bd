"""Equivalence rewrites of grammars/schema_rewrite.py checked against jsonschema: merging allOf members
into their owner and dropping a `type` that $ref/anyOf already imply keep every verdict; a merge that
would separate coupled keywords (properties / additionalProperties) is not made."""

from __future__ import annotations

import copy
import itertools
import json

import jsonschema
import pytest

from radixlm.grammars.schema_rewrite import rewrite

PROBES = [None, 1, 2.5, "a", "abc", [], [1], {}, {"a": 1}, {"a": "x"}, {"b": 1}, {"a": 1, "b": 2}, {"c": []}]

CASES = [
    {"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}], "type": "object"},
    {"allOf": [{"additionalProperties": False}], "properties": {"a": {}}},  # coupled: not merged
    {"allOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"allOf": [{"minLength": 2}], "type": ["string", "object"], "maxLength": 2},
    {
        "$defs": {"o": {"type": "object"}},
        "anyOf": [{"$ref": "#/$defs/o"}, {"const": {"c": []}}],
        "type": "object",
    },
    {"$defs": {"o": {"type": "object"}}, "anyOf": [{"$ref": "#/$defs/o"}, {"const": 1}], "type": "object"},
    {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "type": "number"},
]


@pytest.mark.parametrize("schema", CASES, ids=lambda s: json.dumps(s)[:50])
def test_rewrites_keep_every_verdict(schema: dict) -> None:
    out = rewrite(copy.deepcopy(schema))
    before, after = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(out)
    for value in PROBES:
        assert before.is_valid(value) == after.is_valid(value), (value, out)


def test_what_is_merged_and_what_is_not() -> None:
    assert "allOf" not in rewrite(copy.deepcopy(CASES[0]))
    assert "allOf" in rewrite(copy.deepcopy(CASES[1]))
    assert "type" not in rewrite(copy.deepcopy(CASES[4]))
    assert "type" in rewrite(copy.deepcopy(CASES[5]))  # the const branch is not an object


UNIQUE_CASES = [
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
    {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1},
    {"type": "array", "items": {"enum": [1, True, None, 1]}, "uniqueItems": True},
    {"type": "array", "items": {"const": "x"}, "uniqueItems": True},
]


@pytest.mark.parametrize("schema", UNIQUE_CASES)
def test_unique_items_over_few_values_is_exact(schema: dict) -> None:
    """Every array of length <= 4 over the item values (and one outsider) is valid after the rewrite
    exactly when jsonschema says it is valid against the original."""
    out = rewrite(copy.deepcopy(schema))
    assert "uniqueItems" not in out
    pool = [*({json.dumps(v): v for v in _item_values(schema)}.values()), "z"]
    for n in range(5):
        for arr in itertools.product(pool, repeat=n):
            value = list(arr)
            assert jsonschema.Draft202012Validator(out).is_valid(value) == jsonschema.Draft202012Validator(
                schema
            ).is_valid(value), value


def _item_values(schema: dict) -> list:
    items = schema["items"]
    return [items["const"]] if "const" in items else items.get("enum", [False, True])


def test_unique_items_over_many_values_is_left_to_the_value_check() -> None:
    """Twelve values make 1.3e9 arrays of distinct items: counted, not listed, and kept."""
    schema = {"type": "array", "items": {"enum": [f"v{i}" for i in range(12)]}, "uniqueItems": True}
    assert rewrite(copy.deepcopy(schema)) == schema


def test_unique_items_kept_when_types_beyond_arrays() -> None:
    schema = {"type": ["array", "null"], "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    assert rewrite(copy.deepcopy(schema)) == schema


IF_CASES = [
    {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b", "c"]}, "n": {"type": "integer"}},
        "required": ["kind"],
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"required": ["n"]},
        "else": {"properties": {"n": {"maximum": 0}}},
    },
    {
        "type": "object",
        "properties": {"kind": {"type": "string", "enum": ["a", "b"]}, "n": {}},
        "required": ["kind"],
        "if": {"properties": {"kind": {"enum": ["b"]}}, "required": ["kind"]},
        "then": {"properties": {"n": {"type": "string"}}},
    },
]


@pytest.mark.parametrize("schema", IF_CASES)
def test_if_on_a_required_enum_is_exact(schema: dict) -> None:
    out = rewrite(copy.deepcopy(schema))
    assert not {"if", "then", "else"} & set(out)
    for kind in ("a", "b", "c", "d", 1, None):
        for n in (None, -1, 3, "x"):
            for doc in ({"kind": kind, "n": n}, {"kind": kind}, {"n": n}):
                want = jsonschema.Draft202012Validator(schema).is_valid(doc)
                assert jsonschema.Draft202012Validator(out).is_valid(doc) == want, doc


def test_if_on_an_optional_property_is_kept() -> None:
    schema = copy.deepcopy(IF_CASES[0])
    schema["required"] = []
    assert "if" in rewrite(copy.deepcopy(schema))
