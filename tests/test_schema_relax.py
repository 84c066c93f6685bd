"""Relaxation when llguidance refuses a schema: the construct llguidance names leaves the grammar (which
only ever widens: every instance valid against the original schema per jsonschema is still accepted)
and a value check holds it, named with its JSON pointer, in strict and non-strict mode alike. Over-budget relaxation is refused
with a reason. Strict mode enforces the exact rewrites end to end (uniqueItems over an enum, if/then/else
on a required discriminator)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jsonschema
import pytest
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend, grammar_backend
from radixlm.grammars.schema_walk import resolve_pointer


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152, use_disk_cache=False)


def accepts(backend: GrammarBackend, grammar, value) -> bool:
    m = grammar.new_matcher()
    text = json.dumps(value, separators=(", ", ": "))
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    return (
        all(m.accept_token(t) for t in ids)
        and m.accept_token(backend.stop_token_ids[0])
        and m.is_terminated()
    )


NODE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/definitions/node"}},
    },
}
CASES = [
    pytest.param(
        {"type": "object", "patternProperties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        "patternProperties at #",
        [{"ab": 1}, {"a": 2, "c": "x"}],
        [{"ab": "x"}, {"b": 1.5}],
        id="overlapping-pattern-properties",
    ),
    pytest.param(
        {
            "type": "object",
            "patternProperties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "additionalProperties": False,
        },
        "additionalProperties at #",  # it goes too: it would refuse the keys the patterns allowed
        [{"ab": 1}, {"b": 2}],
        [{"c": 1}, {"a": "x"}],
        id="overlapping-pattern-properties-closed",
    ),
    pytest.param(
        {
            "type": "object",
            "properties": {"s": {"type": "string", "pattern": "^(?!@@)[a-z@]+$"}},
            "required": ["s"],
        },
        "pattern at #/properties/s",
        [{"s": "a@b"}, {"s": "abc"}],
        [{"s": "@@a"}],
        id="lookahead-pattern",
    ),
    pytest.param(
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "integer"},
            "minProperties": 1,
        },
        "minProperties at #",
        [{"a": 1}, {"a": 1, "b": 2}],
        [{}],
        id="min-properties-beside-optional",
    ),
    pytest.param(
        {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1.79769e308}}},
        "maximum at #/properties/x",
        [{"x": 0.5}, {"x": 12345}],
        [{"x": -1}],
        id="bound-near-double-max",
    ),
]


@pytest.mark.parametrize(("schema", "named", "valid", "invalid"), CASES)
def test_refused_constructs_relaxed_and_checked(
    backend: GrammarBackend, schema: dict, named: str, valid: list, invalid: list
) -> None:
    for strict in (True, False):
        g = backend.compile("json_schema", schema, strict=strict)
        assert any(d.startswith(named) for d in g.checked_keywords), g.checked_keywords
        assert g.dropped_keywords == []
        for value in valid:
            jsonschema.validate(value, schema)  # the examples are valid: widening must keep them
            assert accepts(backend, g, value), value
        for value in invalid:
            assert not jsonschema.Draft202012Validator(schema).is_valid(value)
            assert not accepts(backend, g, value), value


def test_relaxation_keeps_what_it_does_not_drop(backend: GrammarBackend) -> None:
    """Only the lookahead pattern goes: the sibling property's type and the required list stay."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(?!x)[a-z]+$"}, "n": {"type": "integer"}},
        "required": ["s", "n"],
    }
    g = backend.compile("json_schema", schema, strict=False)
    assert accepts(backend, g, {"s": "ab", "n": 1})
    assert not accepts(backend, g, {"s": "ab", "n": "1"})
    assert not accepts(backend, g, {"s": "ab"})


def test_percent_encoded_pointer_resolves(backend: GrammarBackend) -> None:
    schema = {
        "type": "object",
        "patternProperties": {"[a-z]+": {"type": "integer"}},
        "properties": {"n": {"$ref": "#/patternProperties/%5Ba-z%5D%2B"}},
    }
    assert resolve_pointer(schema, "#/patternProperties/%5Ba-z%5D%2B") == {"type": "integer"}
    g = backend.compile("json_schema", schema)
    assert accepts(backend, g, {"n": 3})
    assert not accepts(backend, g, {"n": "3"})


def test_relaxation_over_budget_is_refused(backend: GrammarBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_backend, "RELAX_BUDGET_S", 0.0)
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(?!q)[a-z]+$"}}}
    with pytest.raises(ValueError, match="budget"):
        backend.compile("json_schema", schema, strict=False)


MASKBENCH = Path("/work/shared/data/jsonschemabench/maskbench_dev.jsonl.gz")
# Refused by llguidance as they stand: recursive $refs intersected with siblings, an external
# base URI, overlapping patternProperties, lookaround regexes.
REFUSED = {
    "Github_ultra---o69206",
    "Github_ultra---o91126",
    "Handwritten---test.NoType",
    "JsonSchemaStore---chrome-extension-locales-messages",
    "JsonSchemaStore---web-types",
}


def test_refused_maskbench_schemas_compile_relaxed(backend: GrammarBackend) -> None:
    """Each compiles non-strict with its drops named, and accepts every instance jsonschema and the
    label agree is valid (widening only)."""
    if not MASKBENCH.exists():
        pytest.skip("MaskBench development sample not present")
    with gzip.open(MASKBENCH, "rt") as f:
        docs = {row["source"]: row["doc"] for row in map(json.loads, f) if row["source"] in REFUSED}
    assert set(docs) == REFUSED
    checked = 0
    for name, doc in docs.items():
        g = backend.compile("json_schema", doc["schema"], strict=False)
        names = g.dropped_keywords + g.checked_keywords
        assert names and all(" at #" in d for d in names), name
        cls = jsonschema.validators.validator_for(doc["schema"])
        validator = cls(doc["schema"])
        for t in doc["tests"]:
            if t["valid"] and validator.is_valid(t["data"]):
                assert accepts(backend, g, t["data"]), (name, t["data"])
                checked += 1
    assert checked >= 3


def test_unique_items_over_an_enum_enforced_strict(backend: GrammarBackend) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True, "minItems": 1}
    g = backend.compile("json_schema", schema)
    assert not g.dropped_keywords
    for value in (["a"], ["c", "a"], ["b", "c", "a"], [], ["a", "a"], ["a", "b", "a"], ["d"]):
        assert accepts(backend, g, value) == jsonschema.Draft202012Validator(schema).is_valid(value), value


def test_if_on_a_required_discriminator_enforced_strict(backend: GrammarBackend) -> None:
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
        "required": ["kind"],
        "additionalProperties": False,
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"required": ["n"]},
        "else": {"properties": {"n": {"maximum": 0}}},
    }
    g = backend.compile("json_schema", schema)
    docs = [
        {"kind": "a", "n": 5},
        {"kind": "a"},
        {"kind": "b"},
        {"kind": "b", "n": 5},
        {"kind": "b", "n": -1},
    ]
    for value in docs:
        assert accepts(backend, g, value) == jsonschema.Draft202012Validator(schema).is_valid(value), value


@pytest.mark.parametrize(
    "every_name", [{"$ref": "#/definitions/node"}, {"type": "object", "required": ["v"]}]
)
def test_recursive_ref_beside_an_every_name_pattern_is_strict_and_exact(
    backend: GrammarBackend, every_name: dict
) -> None:
    """A property holding a recursive $ref beside a pattern that every name matches: strict mode
    enforces both (the property's schema and the pattern's) exactly, as jsonschema judges."""
    schema = {
        "definitions": {"node": NODE},
        "type": "object",
        "properties": {"by": {"$ref": "#/definitions/node"}},
        "patternProperties": {"^[a-z]*": every_name},
    }
    g = backend.compile("json_schema", schema)
    validator = jsonschema.Draft7Validator(schema)
    values = [
        {"by": {"v": 1}},
        {"by": {"kids": []}},
        {"by": {"v": 1, "kids": [{"v": "x"}]}},
        {"by": {"v": 1, "kids": [{}]}},
        {"x": {"v": 2}},
        {"x": {}},
    ]
    for value in values:
        assert accepts(backend, g, value) == validator.is_valid(value), value
