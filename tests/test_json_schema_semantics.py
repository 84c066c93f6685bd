"""JSON-schema acceptance follows the schema's semantics while the generation mask follows the generation
policy: extra properties where the schema allows them, any property order, unbounded integers are
accepted; the mask writes declared order (extra keys only where the schema says so) and integers of
at most 16 digits; invalid documents are refused either way."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_helpers import random_walk
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend, allocate_token_bitmask
from radixlm.grammars.schema_subsume import implies


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152, use_disk_cache=False)


def walk(backend: GrammarBackend, grammar, value) -> tuple[bool, bool]:
    """(accepted with EOS terminating, every token inside the mask)."""
    m = grammar.new_matcher()
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    bitmask = allocate_token_bitmask(1, 49152)
    in_mask = True
    for tok in [*backend.tokenizer.encode(text, add_special_tokens=False), backend.stop_token_ids[0]]:
        m.fill_next_token_bitmask(bitmask, 0)
        in_mask = in_mask and bool((int(bitmask[0, tok // 32]) >> (tok % 32)) & 1)
        if not m.accept_token(tok):
            return False, in_mask
    return m.is_terminated(), in_mask


def assert_exact(backend: GrammarBackend, grammar, schema: dict, valid: list, invalid: list) -> None:
    """The examples are what jsonschema says they are, and the grammar accepts exactly the valid ones."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    for v in valid:
        assert validator.is_valid(v) and walk(backend, grammar, v)[0], v
    for v in invalid:
        assert not validator.is_valid(v) and not walk(backend, grammar, v)[0], v


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "host": {"type": "string", "format": "hostname"},
    },
    "required": ["name", "age"],
}


@pytest.mark.parametrize(
    "value,accepted,in_mask",
    [
        ({"name": "a", "age": 3}, True, True),
        ({"name": "a", "age": 3, "extra": [1]}, True, False),  # open object: extra keys read, not written
        ({"age": 3, "name": "a"}, True, False),  # any property order
        ({"host": "example.com", "age": 3, "name": "a"}, True, False),
        ({"name": "a", "age": 10**20}, True, False),  # integers are unbounded in the schema
        ({"age": 3}, False, False),
        ({"age": "3", "name": "a"}, False, False),
        ({"host": "-bad-", "age": 3, "name": "a"}, False, False),  # formats hold in any order
        ({"extra": 1, "age": 3.5, "name": "a"}, False, False),
    ],
)
def test_acceptance_is_the_schema_mask_is_the_policy(
    backend: GrammarBackend, value, accepted: bool, in_mask: bool
) -> None:
    g = backend.compile("json_schema", PERSON)
    if "host" not in value:  # jsonschema checks hostnames only with the optional fqdn package
        assert jsonschema.Draft202012Validator(PERSON).is_valid(value) == accepted
    got_accepted, got_in_mask = walk(backend, g, value)
    assert got_accepted == accepted
    if accepted:
        assert got_in_mask == in_mask


def test_closed_objects_stay_closed_in_any_order(backend: GrammarBackend) -> None:
    closed = {**PERSON, "additionalProperties": False}
    g = backend.compile("json_schema", closed)
    assert walk(backend, g, {"age": 3, "name": "a"})[0]
    assert not walk(backend, g, {"age": 3, "name": "a", "x": 1})[0]
    assert not walk(backend, g, {"name": "a", "age": 3, "x": 1})[0]


def test_generation_mask_writes_declared_order(backend: GrammarBackend) -> None:
    g = backend.compile("json_schema", {**PERSON, "additionalProperties": False})
    for seed in range(4):
        ids, done = random_walk(
            [g.new_matcher()], 49152, backend.vocab.token_bytes, backend.vocab.eos_ids, seed, max_steps=300
        )
        if done:
            doc = json.loads(backend.tokenizer.decode(ids))
            assert list(doc) == [k for k in PERSON["properties"] if k in doc]
            jsonschema.validate(doc, PERSON)


def test_generation_on_an_open_object_writes_valid_documents(backend: GrammarBackend) -> None:
    g = backend.compile("json_schema", PERSON)
    finished = 0
    for seed in range(6):
        ids, done = random_walk(
            [g.new_matcher()], 49152, backend.vocab.token_bytes, backend.vocab.eos_ids, seed, max_steps=300
        )
        if done:
            finished += 1
            jsonschema.validate(json.loads(backend.tokenizer.decode(ids)), PERSON)
    assert finished


def test_rollback_and_reset_across_readings(backend: GrammarBackend) -> None:
    g = backend.compile("json_schema", PERSON)
    m = g.new_matcher()
    ids = backend.tokenizer.encode('{"age": 3, "name": "a"}', add_special_tokens=False)
    assert all(m.accept_token(t) for t in ids)
    m.rollback(2)
    assert m.accept_string('"}')
    assert m.accept_token(backend.stop_token_ids[0]) and m.is_terminated()
    m.reset()
    assert not m.is_terminated() and m.accept_string('{"name": "b", "age": 1}')


DISJOINT_ONE_OF = [
    {
        "oneOf": [{"$ref": "#/$defs/d"}, {"type": "null"}],
        "$defs": {"d": {"type": "string", "format": "date"}},
    },
    {"oneOf": [{"const": 1, "title": "a"}, {"const": 2}]},
    {
        "type": "object",
        "oneOf": [
            {"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
            {"properties": {"kind": {"enum": ["b", "c"]}}, "required": ["kind", "y"]},
        ],
    },
]


@pytest.mark.parametrize("schema", DISJOINT_ONE_OF)
def test_provably_exclusive_one_of_is_enforced(backend: GrammarBackend, schema: dict) -> None:
    g = backend.compile("json_schema", schema)
    values = [
        None,
        1,
        2,
        3,
        "2024-01-02",
        "x",
        {"kind": "a", "x": 1},
        {"kind": "b", "y": 0},
        {"kind": "a"},
        {"kind": "c"},
        {"kind": "b", "y": 1, "x": "s"},
    ]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for v in values:
        assert walk(backend, g, v)[0] == validator.is_valid(v), v


def test_overlapping_one_of_held_by_a_value_check(backend: GrammarBackend) -> None:
    schema = {
        "type": "object",
        "properties": {"r": {"type": "number"}, "w": {"type": "number"}},
        "oneOf": [{"required": ["r"], "properties": {"r": {"minimum": 0}}}, {"required": ["w"]}],
    }
    validator = jsonschema.Draft202012Validator(schema)
    for strict in (True, False):
        g = backend.compile("json_schema", schema, strict=strict)
        assert "oneOf at # (as anyOf)" in g.checked_keywords and not g.dropped_keywords
        for value in [{"r": 1}, {}, {"w": 1}, {"r": 1, "w": 2}, {"r": -1, "w": 2}]:
            assert walk(backend, g, value)[0] == validator.is_valid(value), value


def test_closed_mask_when_llguidance_refuses_the_open_grammar(backend: GrammarBackend) -> None:
    # llguidance takes minProperties beside optional properties only when the object is closed: the
    # mask then writes the closed object, and other documents are read as JSON and checked at EOS
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "minProperties": 1,
    }
    g = backend.compile("json_schema", schema)
    validator = jsonschema.Draft202012Validator(schema)
    for value in [{}, {"a": 1}, {"b": "x", "a": 2}, {"z": 1}, {"a": "1"}, {"a": 1, "z": None}]:
        accepted, in_mask = walk(backend, g, value)
        assert accepted == validator.is_valid(value), value
        if value in ({"a": 1},):
            assert in_mask


TREE = {
    "type": "object",
    "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 1},
        "name": {"type": "string"},
    },
    "required": ["name"],
    "additionalProperties": False,
}
# Recursive references that llguidance would have to intersect with a sibling schema; rewritten so it
# need not, with the same valid instances: (schema, valid instances, invalid instances).
RECURSIVE_WITH_SIBLINGS = [
    (  # annotations beside a recursive $ref assert nothing
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "next": {"$ref": "#/$defs/node", "description": "d"},
                        "v": {"type": "integer"},
                    },
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        [{"v": 1, "next": {"v": 2, "next": {}}}],
        [{"v": "x"}, {"next": {"w": 1}}, {"next": 3}],
    ),
    (  # drafts 3-7 ignore every keyword beside $ref (here the "type": "string")
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {
                "n": {
                    "type": "object",
                    "properties": {"c": {"$ref": "#/definitions/n", "type": "string"}},
                    "additionalProperties": False,
                }
            },
            "$ref": "#/definitions/n",
        },
        [{"c": {"c": {}}}, {}],
        [{"c": "s"}, {"c": {"d": 1}}, []],
    ),
    (  # a property implying the schema of a pattern every name matches is cut out of the pattern
        {
            "$defs": {"t": TREE},
            "type": "object",
            "properties": {
                "main": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 1, "title": "m"}
            },
            "patternProperties": {
                ".*": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/t"}, {"type": "integer"}]}}
            },
        },
        [{"main": [{"name": "a", "kids": [{"name": "b"}]}], "other": [1, {"name": "b"}]}, {}],
        [{"main": [1]}, {"main": [{"name": "a"}, {"name": "b"}]}, {"other": ["s"]}, {"other": 3}],
    ),
    (  # a property whose schema is the matching pattern's says nothing more
        {
            "$defs": {"t": TREE},
            "type": "object",
            "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/t"}, "title": "A"}},
            "patternProperties": {"^[a-z]+$": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
            "additionalProperties": False,
        },
        [{"a": [{"name": "x"}], "bc": []}, {}],
        [{"a": [1]}, {"B": []}, {"bc": [{"kids": []}]}],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), RECURSIVE_WITH_SIBLINGS)
def test_recursive_refs_beside_siblings_compile_strictly(
    backend: GrammarBackend, schema: dict, valid: list, invalid: list
) -> None:
    assert_exact(backend, backend.compile("json_schema", schema), schema, valid, invalid)


def test_inclusion_is_proved_or_not_claimed() -> None:
    root = {"$defs": {"t": TREE}}
    closed = {"type": "object", "properties": {"a": {"const": 1}}, "additionalProperties": False}
    assert implies(closed, {"type": "object", "properties": {"a": {"type": "integer"}}}, root)
    assert implies({"$ref": "#/$defs/t"}, {"anyOf": [{"type": "null"}, {"required": ["name"]}]}, root)
    assert not implies(
        {**closed, "additionalProperties": True}, {"properties": {"b": {"type": "null"}}}, root
    )
    assert not implies({"type": "integer"}, {"type": "integer", "minimum": 0}, root)
    assert not implies({"type": "array", "items": {"type": "string"}}, {"items": {"minLength": 1}}, root)


# `not` over keywords whose failure a grammar states exactly: (schema, valid, invalid).
NEGATIONS = [
    (
        {"type": "object", "properties": {"s": {"type": "string", "not": {"pattern": "^[\\s.,*\\-]+$"}}}},
        [{"s": "ab"}, {"s": ""}, {"s": " a."}, {}],
        [{"s": " .,"}, {"s": "-"}, {"s": "\n"}, {"s": " \n"}, {"s": 1}],
    ),
    ({"not": {"pattern": "^[\\sa]*$"}}, ["b", "ab\n."], ["", "a", "\n", "a \n", 2]),
    (
        {"not": {"enum": [6, "foo", [], True, {"foo": 12}, [{"a": [False]}]]}},
        [5, "fo", [1], False, {"foo": 12.5}, {"foo": 12, "x": 1}, {}, [{"a": [True]}], [{"a": []}], None],
        [6, 6.0, "foo", [], True, {"foo": 12}, {"foo": 12.0}, [{"a": [False]}]],
    ),
    (
        {"not": {"const": {"a": {"b": None}, "c": "d"}}},
        [{"a": {"b": 0}, "c": "d"}, {"c": "d"}],
        [{"c": "d", "a": {"b": None}}],
    ),
    ({"not": {"pattern": "^[ab]"}}, ["cab", "", "\n", "\na"], ["abc", "b", "a\n", 3, None, {"a": 1}]),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), NEGATIONS)
def test_negation_is_exact(backend: GrammarBackend, schema: dict, valid: list, invalid: list) -> None:
    assert_exact(backend, backend.compile("json_schema", schema), schema, valid, invalid)


# oneOf whose branches overlap, rewritten exactly: (schema, valid, invalid).
OVERLAPPING_ONE_OF = [
    (
        {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"], "description": "d"}]},
        [{"a": 1}, {"b": None, "c": 2}],
        [{"a": 1, "b": 2}, {}, {"c": 1}, 3],
    ),
    (
        {"oneOf": [{"required": ["t", "v"]}, {"required": ["t", "lo", "hi"]}, {"required": ["t"]}]},
        [{"t": 1}, {"t": 1, "lo": 0}],
        [{"t": 1, "v": 2}, {"t": 1, "lo": 0, "hi": 2}, {}, "s"],
    ),
    ({"oneOf": [{"enum": ["linux"]}, {"type": "string"}]}, ["osx", ""], ["linux", 3, None]),
    (
        {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "number"}, "title": "n"},
                {"type": "array", "items": {"type": "string"}},
            ]
        },
        ["s", [1, 2.5], ["a"]],
        [[], [1, "a"], 3, None],
    ),
    (
        {"type": "string", "oneOf": [{"enum": ["/bin/vi", "/bin/ed"]}, {}]},
        ["/bin/nano", "/bin/v"],
        ["/bin/vi", "/bin/ed", 1],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), OVERLAPPING_ONE_OF)
def test_overlapping_one_of_rewritten_exactly(
    backend: GrammarBackend, schema: dict, valid: list, invalid: list
) -> None:
    assert_exact(backend, backend.compile("json_schema", schema), schema, valid, invalid)


# Keywords beside a finite enum, decided value by value: (schema, valid, invalid).
FINITE = [
    (
        {"enum": [1, 1.5, "a", [1, 1], [1, 2], {"a": 1}], "not": {"type": "integer"}},
        [1.5, "a", [1, 1], {"a": 1}],
        [1, 2, "b"],
    ),
    ({"enum": [[1, 1], [1, 2], [3]], "uniqueItems": True}, [[1, 2], [3]], [[1, 1], [2, 1]]),
    (
        {"const": {"a": 1}, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        [],
        [{"a": 1}, {"a": 1, "b": 2}],
    ),
    (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "enum": [{"x": 1}, {"y": 2}],
            "propertyNames": {"pattern": "^x"},
        },
        [{"x": 1}],
        [{"y": 2}, {"x": 2}],
    ),
    (
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z_][a-z0-9_]*$"},
            "properties": {"id": {"type": "string"}, "Bad": {}, "9x": {}},
            "additionalProperties": False,
        },
        [{"id": "a"}, {}],
        [{"Bad": 1}, {"9x": 1}, {"other": 1}, {"id": 1}],
    ),
]


@pytest.mark.parametrize(("schema", "valid", "invalid"), FINITE)
def test_keywords_beside_a_finite_enum(
    backend: GrammarBackend, schema: dict, valid: list, invalid: list
) -> None:
    try:
        g = backend.compile("json_schema", schema)
    except ValueError:
        assert not valid  # a schema nothing satisfies may be refused as such
        return
    assert_exact(backend, g, schema, valid, invalid)
