"""JSON schemas through our FSM (JSON schema → regex) and through xgrammar: every finished random
walk parses and validates with `jsonschema`; bad or unsupported schemas raise ValueError naming why."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from radixlm.grammars import GrammarBackend, json_schema_to_regex, normalize_json_schema
from radixlm.grammars.testing import load_default_tokenizer, random_walk

S = {"type": "string", "maxLength": 8}
I = {"type": "integer"}  # noqa: E741
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"a": I, "b": S, "c": {"type": "boolean"}}, "required": ["b"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}}, "required": ["ok", "none"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}, "n": {"const": 3}}, "required": ["v", "n"]},
    {"type": "array", "items": I, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": S, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"k": I}, "required": ["k"]}},
     "required": ["inner"]},
    {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {"type": "object", "properties": {
        "l3": S}, "required": ["l3"]}}, "required": ["l2"]}}, "required": ["l1"]},
    {"anyOf": [I, S]},
    {"type": "object", "properties": {"v": {"anyOf": [I, {"type": "null"}]}}, "required": ["v"]},
    {"type": ["string", "null"], "maxLength": 5},
    {"$defs": {"P": {"type": "object", "properties": {"x": I, "y": I}, "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/P"}, "b": {"$ref": "#/$defs/P"}}, "required": ["a"]},
    {"definitions": {"C": {"enum": [1, 2, 3]}}, "type": "array", "items": {"$ref": "#/definitions/C"}, "maxItems": 3},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "integer", "minimum": 0},
    {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": I}}, "required": ["m"]},
    {"type": "object", "properties": {"ünï": S, "名前": S}, "required": ["名前"]},
    {"type": "object", "properties": {"q": {"enum": ["say \"hi\"", "back\\slash", "naïve"]}}, "required": ["q"]},
    {"type": "object", "properties": {"e": {"enum": [None, True, 1.5, "s", [1, 2], {"k": "v"}]}}, "required": ["e"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": I, "tags": {"type": "array", "items": S,
                                                                                     "maxItems": 2}},
                                "required": ["id"]}, "maxItems": 2},
    {"type": "object", "properties": {"p": {"allOf": [{"type": "integer"}]}, "s": {"type": "string"}},
     "required": ["p", "s"], "additionalProperties": False},
    {"type": "object", "title": "T", "description": "d", "properties": {"a": {"type": "integer", "default": 1}},
     "required": ["a"]},
    {"type": "object", "properties": {"opt1": I, "opt2": I, "opt3": I}},
    {"type": "boolean"},
]


class Address(BaseModel):
    street: str = Field(max_length=10)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["a", "b"]
    address: Address
    nick: str | None = None


N_WALKS = 3


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(load_default_tokenizer(), 49152)


def _validate_walks(backend: GrammarBackend, schema: dict, engine: str) -> None:
    grammar = backend.compile("json_schema", schema, engine=engine)
    assert grammar.engine == engine
    for seed in range(N_WALKS):
        ids, finished = random_walk([grammar.new_matcher()], backend.vocab_size, backend.vocab.token_bytes,
                                    backend.vocab.eos_ids, seed, max_steps=400)
        assert finished, f"walk {seed} did not finish"
        text = backend.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("idx", range(len(SCHEMAS)))
@pytest.mark.parametrize("engine", ["fsm", "xgrammar"])
def test_walks_validate(backend: GrammarBackend, idx: int, engine: str) -> None:
    _validate_walks(backend, SCHEMAS[idx], engine)


def test_pydantic_model_through_both_engines(backend: GrammarBackend) -> None:
    schema = Person.model_json_schema()
    assert json.loads(normalize_json_schema(Person)) == schema
    for engine in ("fsm", "xgrammar"):
        _validate_walks(backend, schema, engine)


def test_regex_format_is_compact_json_like_xgrammar(backend: GrammarBackend) -> None:
    regex = json_schema_to_regex(SCHEMAS[0])
    assert re.fullmatch(regex, '{"name": "bo", "age": -12}')
    assert not re.fullmatch(regex, '{"name":"bo","age":-12}')  # whitespace is fixed, never runaway
    assert not re.fullmatch(regex, '{"age": 1, "name": "bo"}')  # declared order


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "object", "if": {}, "then": {}}, "if"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "items": I, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "patternProperties": {"^a": I}}, "patternProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer", "frobnicate": 1}}}, "frobnicate"),
])
@pytest.mark.parametrize("engine", ["fsm", "xgrammar", "auto"])
def test_unsupported_keyword_named(backend: GrammarBackend, schema: dict, keyword: str, engine: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(keyword))):
        backend.compile("json_schema", schema, engine=engine)


@pytest.mark.parametrize("schema,fragment", [
    ('{"type": "object", ', "not valid JSON"),
    ("[1, 2]", "expected an object"),
    ({"type": "strng"}, "unknown type"),
    ({"$ref": "#/$defs/Missing"}, "does not resolve"),
    ({"type": "object", "required": "a"}, "required"),
    ({"enum": []}, "enum"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "maximum 2 < minimum 5"),
])
def test_invalid_schema_rejected(backend: GrammarBackend, schema: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        backend.compile("json_schema", schema, engine="fsm")


def test_auto_falls_back_to_xgrammar_for_non_regular_schemas(backend: GrammarBackend) -> None:
    bounded = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
               "required": ["n"]}
    tree = {"$defs": {"T": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/T"},
                                                                        "maxItems": 2}}, "required": ["kids"]}},
            "$ref": "#/$defs/T"}
    for schema in (bounded, tree):
        with pytest.raises(ValueError, match="not supported by the fsm engine"):
            backend.compile("json_schema", schema, engine="fsm")
        assert backend.compile("json_schema", schema, engine="auto").engine == "xgrammar"
        _validate_walks(backend, schema, "xgrammar")
    assert backend.compile("json_schema", SCHEMAS[0], engine="auto").engine == "fsm"
