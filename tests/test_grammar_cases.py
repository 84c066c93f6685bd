"""Shared test data for the grammar tests (no tests here): the regexes and JSON schemas of issue 4."""

from __future__ import annotations

import functools
from typing import Any

# Written in the syntax both engines accept; ≥ 30 as issue 4 asks.
REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"([01]\d|2[0-3]):[0-5]\d(:[0-5]\d)?",
    r"[a-z0-9._%+-]{1,20}@[a-z0-9-]{1,12}\.(com|org|net)",
    r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
    r"-?\d+",
    r"-?(0|[1-9]\d{0,8})(\.\d{1,4})?",
    r"[+-]?\d+(\.\d+)?[eE][+-]?\d{1,3}",
    r"0x[0-9a-fA-F]{1,8}",
    r"(red|green|blue)",
    r"(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)",
    r'"([^"\\]|\\.){0,20}"',
    r'"([^"\\\n]|\\["\\nt]){0,16}"',
    r"'[^']{0,12}'",
    r"(café|naïve|résumé)",
    r"(日本|中文|한국어)[0-9]{1,2}",
    r"Grüße, [A-Z][a-z]{1,8}!",
    r"[α-ω]{1,5}",
    r"x\u00e9y[\u4e00-\u9fff]{1,2}",
    r'\{"id": \d{1,5}, "ok": (true|false)\}',
    r"\[(\d{1,3}(, \d{1,3}){0,4})?\]",
    r'\{"name": "[A-Za-z ]{1,16}", "tags": \["[a-z]{1,6}"(, "[a-z]{1,6}"){0,2}\]\}',
    r"[A-Z]{3}-\d{3}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[a-f0-9]{8}-[a-f0-9]{4}-4[a-f0-9]{3}-[89ab][a-f0-9]{3}-[a-f0-9]{12}",
    r"https?://[a-z]{1,10}\.(com|org)(/[a-z]{1,8}){0,3}",
    r"#[0-9a-fA-F]{6}",
    r"v\d+\.\d+\.\d+",
    r"[A-Za-z_][A-Za-z0-9_]{0,15}",
    r"(\+|-)?[1-9]\d{0,2}(,\d{3}){0,2}",
    r"The answer is (A|B|C|D)\.",
    r"\w{1,10}",
    r"(ab|cd)*e",
    r"[^a-z]{1,6}",
    r"^hello$",
]

S = {"type": "string", "maxLength": 8}
INT_SCHEMA = I = {"type": "integer"}  # noqa: E741
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"a": I, "b": S, "c": {"type": "boolean"}}, "required": ["b"]},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["ok", "none"],
    },
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}, "n": {"const": 3}}, "required": ["v", "n"]},
    {"type": "array", "items": I, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": S, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"k": I}, "required": ["k"]}},
        "required": ["inner"],
    },
    {
        "type": "object",
        "properties": {
            "l1": {
                "type": "object",
                "properties": {"l2": {"type": "object", "properties": {"l3": S}, "required": ["l3"]}},
                "required": ["l2"],
            }
        },
        "required": ["l1"],
    },
    {"anyOf": [I, S]},
    {"type": "object", "properties": {"v": {"anyOf": [I, {"type": "null"}]}}, "required": ["v"]},
    {"type": ["string", "null"], "maxLength": 5},
    {
        "$defs": {"P": {"type": "object", "properties": {"x": I, "y": I}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/P"}, "b": {"$ref": "#/$defs/P"}},
        "required": ["a"],
    },
    {
        "definitions": {"C": {"enum": [1, 2, 3]}},
        "type": "array",
        "items": {"$ref": "#/definitions/C"},
        "maxItems": 3,
    },
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "integer", "minimum": 0},
    {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": I}}, "required": ["m"]},
    {"type": "object", "properties": {"ünï": S, "名前": S}, "required": ["名前"]},
    {
        "type": "object",
        "properties": {"q": {"enum": ['say "hi"', "back\\slash", "naïve"]}},
        "required": ["q"],
    },
    {
        "type": "object",
        "properties": {"e": {"enum": [None, True, 1.5, "s", [1, 2], {"k": "v"}]}},
        "required": ["e"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": I, "tags": {"type": "array", "items": S, "maxItems": 2}},
            "required": ["id"],
        },
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {"p": {"allOf": [{"type": "integer"}]}, "s": {"type": "string"}},
        "required": ["p", "s"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "title": "T",
        "description": "d",
        "properties": {"a": {"type": "integer", "default": 1}},
        "required": ["a"],
    },
    {"type": "object", "properties": {"opt1": I, "opt2": I, "opt3": I}},
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "integer", "minimum": -10, "maximum": 10},
        },
        "required": ["age", "score"],
    },
]


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """The default model's tokenizer through the backend's loader, once per test session."""
    from radixlm.backend.tokenizer import load_tokenizer

    return load_tokenizer(None)
