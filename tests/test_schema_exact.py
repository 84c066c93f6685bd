"""The xgrammar subset (grammars/schema_exact.py): schemas in it get xgrammar's generation grammar, and
on random schemas of the subset that grammar accepts a compact, declared-order document exactly when
jsonschema validates it; schemas outside it keep llguidance's masks; acceptance still follows the
schema's semantics (any property order) through the wider llguidance readings."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend
from radixlm.grammars.schema_exact import xgrammar_exact
from radixlm.grammars.xgrammar_backend import XGrammarCompiled

EMPLOYEE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "engineer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152, use_disk_cache=False)


def _without(schema: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {k: v for k, v in {**schema, **changes}.items() if v is not None}


@pytest.mark.parametrize(
    "schema",
    [
        _without(EMPLOYEE, additionalProperties=None),  # open object: extra keys are valid
        {"type": "string", "format": "email"},
        {"type": "string", "pattern": "[0-9]+"},  # unanchored: a search, not a full match
        {"type": "string", "pattern": "^\\w+$"},  # \w differs between the dialects
        {"type": "string", "pattern": "^[0-9]+$", "maxLength": 4},
        {"type": "string", "enum": ["abc"], "maxLength": 2},
        {"type": "number", "minimum": 0.5},
        {"type": "integer", "minimum": 0.5},
        {"type": ["string", "null"]},
        {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}},
        {"type": "array"},  # any items
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        {"enum": [1.5, "x"]},
        {"enum": ['a"b']},
        {"enum": 5},  # not a list: refused without an error
        {"type": "string", "enum": "ab"},
        {
            "type": "object",
            "properties": {"a": {"type": "string"}},
            "required": ["b"],
            "additionalProperties": False,
        },
    ],
)
def test_outside_the_subset(schema: dict[str, Any]) -> None:
    assert not xgrammar_exact(schema)


def test_inside_the_subset_with_annotations() -> None:
    annotated = {**EMPLOYEE, "title": "Employee", "description": "one record", "x-vendor": {"a": 1}}
    assert xgrammar_exact(annotated)
    assert xgrammar_exact({"enum": ["a", 1, True, None]})


def test_the_subset_gets_xgrammar_masks_and_keeps_any_order_acceptance(backend: GrammarBackend) -> None:
    g = backend.compile("json_schema", EMPLOYEE)
    assert g.mask_engine == "xgrammar"
    open_employee = backend.compile("json_schema", _without(EMPLOYEE, additionalProperties=None))
    assert open_employee.mask_engine == "xgrammar"  # generation closes it; acceptance stays open
    extra = open_employee.new_matcher()
    assert extra.accept_string('{"name": "a", "age": 3, "role": "admin", "team": "x"}')
    assert extra.accept_token(backend.stop_token_ids[0]) and extra.is_terminated()
    closed = backend.compile("json_schema", EMPLOYEE).new_matcher()
    closed_extra = '{"name": "a", "age": 3, "role": "admin", "team": "x"}'
    assert not (closed.accept_string(closed_extra) and closed.accept_token(backend.stop_token_ids[0]))
    m = g.new_matcher()
    reordered = {"role": "admin", "age": 3, "name": "a"}  # valid, outside the declared order
    assert m.accept_string(json.dumps(reordered, separators=(", ", ": ")))
    stop = backend.stop_token_ids[0]
    assert m.accept_token(stop) and m.is_terminated()
    assert m.mode != "generation"  # a wider reading (llguidance, then JSON + jsonschema) took over
    bad = g.new_matcher()  # invalid in every reading: age above its maximum
    assert not (bad.accept_string('{"name": "a", "age": 121, "role": "admin"}') and bad.accept_token(stop))


# ---- random schemas of the subset, random documents -------------------------------------------

ALPHABET = "ab09 _-Z"
PATTERNS = ["^[0-9]{3}$", "^(ab|cd)+$", "^[A-Z][a-z]*$", "^a?b*$", "^[a-c0-9_-]{1,3}$"]
NAMES = ["a", "b", "c d", "e-f"]


def leaf_schemas() -> st.SearchStrategy[dict[str, Any]]:
    small = st.integers(0, 6)
    text = st.text(ALPHABET, max_size=4)
    return st.one_of(
        st.builds(
            lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra}, small, small
        ),
        st.just({"type": "string"}),
        st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
        st.lists(text, min_size=1, max_size=3, unique=True).map(lambda v: {"type": "string", "enum": v}),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-300, 300),
            st.integers(0, 700),
        ),
        st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.just({"type": "number"}),
        st.lists(st.one_of(text, st.integers(-9, 9), st.booleans(), st.none()), min_size=1, max_size=3).map(
            lambda v: {"enum": v}
        ),
    )


def _object(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _array(items: dict[str, Any], lo: int, extra: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra}


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    def extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        props = st.dictionaries(st.sampled_from(NAMES), children, max_size=3)
        obj = props.flatmap(
            lambda p: (
                st.lists(st.sampled_from(sorted(p)), unique=True).map(lambda r: _object(p, r))
                if p
                else st.just(_object({}, []))
            )
        )
        return st.one_of(obj, st.builds(_array, children, st.integers(0, 2), st.integers(0, 2)))

    return st.recursive(leaf_schemas(), extend, max_leaves=6)


def documents(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Mostly near-valid documents (declared key order), sometimes a value of another shape."""
    kind = schema.get("type")
    other = st.one_of(st.integers(-999, 999), st.text(ALPHABET, max_size=5), st.booleans(), st.none())
    if kind == "object":
        props = schema["properties"]
        parts = [st.tuples(st.just(k), st.booleans(), documents(v)) for k, v in props.items()]
        near = st.tuples(*parts, st.booleans()).map(
            lambda t: {**{k: v for k, keep, v in t[:-1] if keep}, **({"zz": 1} if t[-1] else {})}
        )
    elif kind == "array":
        near = st.lists(documents(schema["items"]), max_size=schema["maxItems"] + 1)
    elif "enum" in schema:
        near = st.one_of(st.sampled_from(schema["enum"]), other)
    elif kind == "string" and "pattern" in schema:
        near = st.one_of(st.from_regex(schema["pattern"], fullmatch=True), st.text("abcd0129AZ", max_size=6))
    elif kind == "string":
        near = st.text(ALPHABET, max_size=9)
    elif kind == "integer":
        near = st.integers(schema.get("minimum", 0) - 3, schema.get("maximum", 400) + 3)
    elif kind == "number":
        near = st.one_of(st.integers(-99, 99), st.floats(-99, 99).map(lambda x: round(x, 3)))
    else:
        near = st.sampled_from([True, False, None])
    return st.one_of(near, near, near, other)


def _accepts(compiled: XGrammarCompiled, doc: Any, stop: int) -> bool:
    m = compiled.new_matcher()
    return m.accept_string(json.dumps(doc, separators=(", ", ": "))) and m.accept_token(stop)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_xgrammar_accepts_exactly_the_valid_documents(backend: GrammarBackend, data: st.DataObject) -> None:
    schema = data.draw(schemas())
    assert xgrammar_exact(schema), schema
    compiled = backend.xgrammar.compile("json_schema", json.dumps(schema))
    validator = jsonschema.Draft202012Validator(schema)
    for _ in range(6):
        doc = data.draw(documents(schema))
        assert _accepts(compiled, doc, backend.stop_token_ids[0]) == validator.is_valid(doc), (schema, doc)


def test_xgrammars_own_cache_is_bounded(backend: GrammarBackend) -> None:
    """Every schema of the subset now compiles through xgrammar too: its compiler cache has a limit."""
    assert 0 < backend.xgrammar.compiler.cache_limit_bytes <= 1 << 30
