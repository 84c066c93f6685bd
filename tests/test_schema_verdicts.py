"""The value checks' verdicts (grammars/schema_verdicts.py) against jsonschema, the reference: where
jsonschema-rs alone reads a schema differently (Python's regex dialect, our format checker, float
multipleOf, keys matched by patternProperties, values Rust cannot hold), the verdict stays
jsonschema's, and each case shows jsonschema-rs alone would have differed."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import jsonschema_rs
import pytest

from radixlm.grammars.schema_formats import format_checker
from radixlm.grammars.schema_guard import GuardPlan, verdict_validator

D7 = "http://json-schema.org/draft-07/schema#"


def _plan(schema: dict[str, Any]) -> GuardPlan:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = verdict_validator(cls)(schema, format_checker=format_checker())
    return GuardPlan(schema, {id(schema): {"not"}}, validator)


def _verdicts(schema: dict[str, Any], values: list[Any]) -> tuple[list[bool], list[bool]]:
    """(ours, jsonschema's) on each value against the whole schema."""
    plan = _plan(schema)
    ours = [plan.node_verdicts.is_valid(schema, json.dumps(v).encode(), v) for v in values]
    return ours, [plan.validator.is_valid(v) for v in values]


def _rs_alone(schema: dict[str, Any], values: list[Any]) -> list[bool | None]:
    rs = jsonschema_rs.validator_for(schema)
    out: list[bool | None] = []
    for v in values:
        try:
            out.append(rs.is_valid(v))
        except ValueError:
            out.append(None)
    return out


DIVERGENT = [
    ({"$schema": D7, "properties": {"a": {"pattern": "^a$"}}}, [{"a": "a\n"}, {"a": "b"}, {"a": "a"}]),
    (
        {"$schema": D7, "format": "uuid"},
        ["00000000-0000-0000-0000-00000000000g", "0" * 8 + "-0000" * 3 + "-" + "0" * 12],
    ),
    ({"multipleOf": 0.1}, [0.3, 0.5]),
    ({"maxLength": 1}, ["\ud800", "ab"]),
    (
        {"$schema": D7, "patternProperties": {"^a$": {"type": "integer"}}},
        [{"a\n": "x"}, {"a": "x"}, {"a": 1}],
    ),
]


@pytest.mark.parametrize("schema, values", DIVERGENT)
def test_verdicts_are_jsonschemas_where_jsonschema_rs_alone_differs(schema: dict, values: list) -> None:
    ours, reference = _verdicts(schema, values)
    assert ours == reference
    assert True in reference and False in reference
    assert _rs_alone(schema, values) != reference  # the case is one jsonschema-rs reads differently


ROUTES = [
    (
        {"$schema": D7, "required": ["a"], "properties": {"a": {"pattern": "^x"}}},
        "any text, own regexes on plain",
    ),
    ({"$schema": D7, "properties": {"a": {"pattern": "^a{,3}$"}}}, "any text"),
    ({"$schema": D7, "patternProperties": {"^[a-z]+$": {"type": "integer"}}}, "plain text"),
    ({"$schema": D7, "patternProperties": {"^a{,3}$": {"type": "integer"}}}, "jsonschema"),
    ({"unevaluatedProperties": False, "properties": {"a": {}}}, "jsonschema"),
    (
        {
            "$schema": D7,
            "properties": {"a": {"$ref": "#/definitions/p"}},
            "definitions": {"p": {"enum": [2**60]}},
        },
        "jsonschema",
    ),
]


@pytest.mark.parametrize("schema, route", ROUTES)
def test_each_schema_object_is_judged_the_way_its_constructs_allow(schema: dict, route: str) -> None:
    judges = _plan(schema).node_verdicts._judges(schema)
    routes = {
        (True, True): "any text, own regexes on plain",
        (True, False): "any text",
        (False, True): "plain text",
        (False, False): "jsonschema",
    }
    rs = judges.pointer is not None
    assert routes[(rs and judges.any_text, rs and judges.own_regexes)] == route


def test_plain_text_objects_use_jsonschema_for_escaped_or_non_ascii_keys() -> None:
    """Keys matched by patternProperties reach jsonschema-rs only as printable ASCII, where Python's
    re and ECMA-262 agree on the portable regexes."""
    schema = {"$schema": D7, "patternProperties": {"^[a-z]+$": {"type": "integer"}}}
    nv = _plan(schema).node_verdicts
    judges = nv._judges(schema)
    assert judges.pointer is not None and judges.own_regexes and not judges.any_text
    calls: list[str] = []
    python, plain = judges.python, nv._rs_validator(judges, True)
    assert plain is not None
    judges.python = lambda v: calls.append("py") or python(v)
    judges.built[True] = lambda v: calls.append("rs") or plain(v)
    nv._by_node[id(schema)] = judges
    for value in ({"ab": 1}, {"\u00e9": 1}, {"a\nb": "x"}):
        nv.is_valid(schema, json.dumps(value, ensure_ascii=False).encode(), value)
    assert calls == ["rs", "py", "py"]


def test_plain_texts_with_portable_patterns_use_jsonschema_rs_regexes() -> None:
    """A portable pattern is read by jsonschema-rs itself on plain text, by Python's re otherwise;
    the verdicts are jsonschema's either way."""
    schema = {"$schema": D7, "pattern": "^[a-z]+\\d$"}
    plan = _plan(schema)
    values = ["ab1", "ab", "ab\u0661", "ab1\n"]  # an Arabic-Indic digit; a trailing newline
    ours = [
        plan.node_verdicts.is_valid(schema, json.dumps(v, ensure_ascii=False).encode(), v) for v in values
    ]
    assert ours == [plan.validator.is_valid(v) for v in values] == [True, False, True, True]


def test_objects_under_keys_that_need_escaping_in_a_uri_get_jsonschema_rs_validators() -> None:
    inner = {"minimum": 3}
    schema = {"$schema": D7, "properties": {"a b%": {"properties": {"^x[y]$": inner}}}}
    plan = _plan(schema)
    nv = plan.node_verdicts
    judges = nv._judges(inner)
    assert nv._rs_validator(judges, True) is not None and nv._rs_validator(judges, False) is not None
    assert [nv.is_valid(inner, str(v).encode(), v) for v in (2, 3)] == [False, True]
