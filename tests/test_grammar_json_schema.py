"""JSON schemas through our FSM (JSON schema → regex) and through xgrammar: every finished random
walk parses and validates with `jsonschema`; bad or unsupported schemas raise ValueError naming why."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pytest
import torch
from grammar_helpers import random_walk
from pydantic import BaseModel, Field
from test_grammar_cases import INT_SCHEMA as I  # noqa: E741
from test_grammar_cases import SCHEMAS, default_tokenizer

from radixlm.grammars import (
    GrammarBackend,
    allocate_token_bitmask,
    json_schema_to_regex,
    normalize_json_schema,
)
from radixlm.grammars.json_schema import int_range_regex


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
    return GrammarBackend(default_tokenizer(), 49152)


def _validate_walks(backend: GrammarBackend, schema: dict, engine: str) -> None:
    grammar = backend.compile("json_schema", schema, engine=engine)
    assert grammar.engine == engine
    for seed in range(N_WALKS):
        ids, finished = random_walk(
            [grammar.new_matcher()],
            backend.vocab_size,
            backend.vocab.token_bytes,
            backend.vocab.eos_ids,
            seed,
            max_steps=400,
        )
        assert finished, f"walk {seed} did not finish"
        text = backend.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("idx", range(len(SCHEMAS)))
@pytest.mark.parametrize("engine", ["fsm", "xgrammar", "llguidance"])
def test_walks_validate(backend: GrammarBackend, idx: int, engine: str) -> None:
    _validate_walks(backend, SCHEMAS[idx], engine)


@pytest.mark.parametrize("schema", [True, "true"])
def test_the_true_schema_takes_any_json_and_false_is_refused(backend: GrammarBackend, schema: object) -> None:
    grammar = backend.compile("json_schema", schema)
    m = grammar.new_matcher()
    for t in backend.tokenizer.encode('[1, {"a": null}]', add_special_tokens=False):
        assert m.accept_token(t)
    assert m.accept_token(sorted(backend.vocab.eos_ids)[0]) and m.is_terminated()
    with pytest.raises(ValueError, match="matches nothing"):
        backend.compile("json_schema", "false")


def test_pydantic_model_through_both_engines(backend: GrammarBackend) -> None:
    schema = Person.model_json_schema()
    assert json.loads(normalize_json_schema(Person)) == schema
    for engine in ("fsm", "xgrammar", "llguidance"):
        _validate_walks(backend, schema, engine)


def test_regex_format_is_compact_json_like_xgrammar(backend: GrammarBackend) -> None:
    regex = json_schema_to_regex(SCHEMAS[0])
    assert re.fullmatch(regex, '{"name": "bo", "age": -12}')
    assert not re.fullmatch(regex, '{"name":"bo","age":-12}')  # whitespace is fixed, never runaway
    assert not re.fullmatch(regex, '{"age": 1, "name": "bo"}')  # declared order


@pytest.mark.parametrize(
    "schema,keyword",
    [
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"not": {"multipleOf": 3}}, "not"),
        ({"type": "array", "items": I, "uniqueItems": True}, "uniqueItems"),
    ],
)
@pytest.mark.parametrize("engine", ["fsm", "xgrammar", "auto"])
def test_keyword_beyond_the_grammar_checked_or_refused_with_pointer(
    backend: GrammarBackend, schema: dict, keyword: str, engine: str
) -> None:
    """The default engine holds it by a value check; a single-grammar engine refuses it (strict) or
    drops and names it (non-strict)."""
    if engine == "auto":
        assert any(
            n.startswith(f"{keyword} at #") for n in backend.compile("json_schema", schema).checked_keywords
        )
        return
    with pytest.raises(ValueError, match=re.escape(f"{keyword!r} at #")):
        backend.compile("json_schema", schema, engine=engine)
    try:
        relaxed = backend.compile("json_schema", schema, engine=engine, strict=False)
    except ValueError as e:  # what is left may not be regular: the fsm engine says so
        assert engine == "fsm" and "not supported by the fsm engine" in str(e)
        return
    assert f"{keyword} at #" in relaxed.dropped_keywords  # dropped, and named


@pytest.mark.parametrize(
    "schema,fragment",
    [
        ('{"type": "object", ', "not valid JSON"),
        ("[1, 2]", "expected an object"),
        ({"type": "strng"}, "unknown type"),
        ({"$ref": "#/$defs/Missing"}, "does not resolve"),
        ({"type": "object", "required": "a"}, "required"),
        ({"enum": []}, "enum"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "maximum 2 < minimum 5"),
    ],
)
def test_invalid_schema_rejected(backend: GrammarBackend, schema: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        backend.compile("json_schema", schema, engine="fsm")


def test_auto_uses_llguidance_for_non_regular_schemas(backend: GrammarBackend) -> None:
    bounded = {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": 0.5, "maximum": 7}},
        "required": ["x"],
    }
    tree = {
        "$defs": {
            "T": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/T"}, "maxItems": 2}},
                "required": ["kids"],
            }
        },
        "$ref": "#/$defs/T",
    }
    for schema in (bounded, tree):
        with pytest.raises(ValueError, match="not supported by the fsm engine"):
            backend.compile("json_schema", schema, engine="fsm")
        assert backend.compile("json_schema", schema, engine="auto").engine == "llguidance"
        _validate_walks(backend, schema, "llguidance")


def test_rollback_returns_to_the_narrower_mode(backend: GrammarBackend) -> None:
    """A token only the any-JSON reading accepts (an undeclared key), then rolled back, as a
    speculative draft walk does: the matcher is back in the generation reading, mask and all."""
    schema = {
        "type": "object",
        "properties": {"order": {"type": "integer"}},
        "required": ["order"],
        "additionalProperties": False,
    }
    m = backend.compile("json_schema", schema).new_matcher()
    opening, order = backend.tokenizer.encode('{"order', add_special_tokens=False)
    (underscore,) = backend.tokenizer.encode("_", add_special_tokens=False)
    masks = allocate_token_bitmask(4, 49152)
    assert m.accept_token(opening)
    m.fill_next_token_bitmask(masks, 0)
    assert m.accept_token(order)
    m.fill_next_token_bitmask(masks, 1)
    assert not masks[1, underscore // 32] >> (underscore % 32) & 1  # "order_..." is not a key
    assert m.accept_token(underscore) and m.mode == "json+check"
    m.rollback(1)
    m.fill_next_token_bitmask(masks, 2)
    assert m.mode == "generation" and torch.equal(masks[2], masks[1])
    # the step that moved is the later of two rolled back
    assert m.accept_token(underscore) and m.mode == "json+check"
    m.rollback(2)
    m.fill_next_token_bitmask(masks, 3)
    assert m.mode == "generation" and torch.equal(masks[3], masks[0])


@pytest.mark.parametrize(
    "lo,hi",
    [
        (0, 0),
        (0, 9),
        (3, 7),
        (0, 120),
        (-5, 5),
        (-120, -3),
        (7, 1234),
        (-1000, 999),
        (10, 99),
        (-99, -10),
        (-317, 2048),
    ],
)
def test_int_range_regex_exact(lo: int, hi: int) -> None:
    pattern = re.compile(int_range_regex(lo, hi))
    for n in range(lo - 300, hi + 300):
        assert bool(pattern.fullmatch(str(n))) == (lo <= n <= hi), n
    for bad in ("01", "-0", "00", "+1", "-01", ""):
        assert not pattern.fullmatch(bad)


def test_integer_bounds_through_fsm(backend: GrammarBackend) -> None:
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "delta": {"type": "integer", "exclusiveMinimum": -4, "exclusiveMaximum": 4},
        },
        "required": ["age", "delta"],
    }
    assert backend.compile("json_schema", schema, engine="fsm").engine == "fsm"
    _validate_walks(backend, schema, "fsm")
    with pytest.raises(ValueError, match="no integer between"):
        backend.compile("json_schema", {"type": "integer", "minimum": 5, "maximum": 4}, engine="fsm")
