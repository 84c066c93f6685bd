"""JSON-Schema policy and correctness through the default engine (llguidance behind our matcher):
annotations ignored, strict refusal with a pointer, non-strict drops named; accepted documents validate
with jsonschema and invalid ones are refused (MaskBench subset); pattern escaping, oneOf exclusivity,
recursion; penalty counts under jump-forward equal the output's token counts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from grammar_helpers import allowed_ids, random_walk
from test_grammar_cases import default_tokenizer

from radixlm.backend.constrained import RequestGrammar, json_schema_error
from radixlm.backend.sampler import record_token
from radixlm.grammars import GrammarBackend
from radixlm.grammars.schema_formats import format_checker

MASKBENCH = Path("/work/shared/data/jsonschemabench/maskbench_dev.jsonl.gz")
SUBSET = 40  # documents: every 70th of the development sample


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152, use_disk_cache=False)


def accepts(backend: GrammarBackend, grammar, text: str) -> bool:
    m = grammar.new_matcher()
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    return (
        all(m.accept_token(t) for t in ids)
        and m.accept_token(backend.stop_token_ids[0])
        and m.is_terminated()
    )


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def test_annotations_and_unknown_keywords_ignored(backend: GrammarBackend) -> None:
    schema = {
        "id": "x",
        "self": {"vendor": "a"},
        "javaType": "X",
        "example": 3,
        "readonly": True,
        "type": "object",
        "properties": {"a": {"type": "integer", "_format": "int", "name": "n"}},
        "required": ["a"],
    }
    g = backend.compile("json_schema", schema)
    assert accepts(backend, g, '{"a": 5}')
    assert not accepts(backend, g, '{"a": "5"}')


CHECKED_CASES = [
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "uniqueItems",
        "#",
        [[1, 2], [1, 1], [3, 2, 3], []],
    ),
    (
        {"type": "object", "properties": {"p": {"type": "string", "not": {"pattern": "^a"}}}},
        "not",
        "#/properties/p",
        [{"p": "ba"}, {"p": "ab"}, {}],
    ),
    (
        {
            "$defs": {"d": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}},
            "$ref": "#/$defs/d",
        },
        "if",
        "#/$defs/d",
        [{"a": 1}, {"a": 1, "b": 2}, {"c": 1}],
    ),
    ({"type": "string", "format": "regex"}, "format", "#", ["[a-z]", "[a-"]),
    (
        {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z]+$"},
            "additionalProperties": {"type": "integer"},
        },
        "propertyNames",
        "#",
        [{"ab": 1}, {"aB": 1}, {}],
    ),
]


@pytest.mark.parametrize("schema,keyword,pointer,values", CHECKED_CASES)
def test_keywords_beyond_the_grammar_are_held_by_value_checks(
    backend: GrammarBackend, schema: dict, keyword: str, pointer: str, values: list
) -> None:
    """Strict mode compiles them, names them as checked, and accepts exactly what jsonschema accepts;
    non-strict does the same (nothing is dropped)."""
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for strict in (True, False):
        g = backend.compile("json_schema", schema, strict=strict)
        assert any(name.startswith(f"{keyword} at {pointer}") for name in g.checked_keywords)
        assert g.dropped_keywords == []
        verdicts = [accepts(backend, g, compact(v)) for v in values]
        assert verdicts == [validator.is_valid(v) for v in values]
        assert True in verdicts and False in verdicts  # the cases hold both kinds


@pytest.mark.parametrize(
    "schema,keyword,pointer,dropped",
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
            "$ref",
            "#/properties/a",
            "$ref at #/properties/a",
        ),
    ],
)
def test_strict_refuses_what_no_check_can_hold_nonstrict_names_drop(
    backend: GrammarBackend, schema: dict, keyword: str, pointer: str, dropped: str
) -> None:
    with pytest.raises(ValueError) as info:
        backend.compile("json_schema", schema)
    assert keyword in str(info.value) and f"at {pointer} " in str(info.value)
    g = backend.compile("json_schema", schema, strict=False)
    assert any(name.startswith(dropped) for name in g.dropped_keywords), g.dropped_keywords


def test_value_checks_clear_refused_completions_from_the_mask(backend: GrammarBackend) -> None:
    """A duplicate string cannot be closed, but it can go on; a walk that finishes validates."""
    schema = {
        "type": "array",
        "items": {"type": "string", "maxLength": 4},
        "uniqueItems": True,
        "maxItems": 3,
    }
    g = backend.compile("json_schema", schema)
    m = g.new_matcher()
    for t in backend.tokenizer.encode('["ab", "ab', add_special_tokens=False):
        assert m.accept_token(t)
    bitmask = torch.zeros((1, 1536), dtype=torch.int32)
    m.fill_next_token_bitmask(bitmask, 0)
    allowed = {backend.vocab.token_bytes[i] for i in allowed_ids(bitmask[0], 49152)}
    assert not any(b.startswith(b'"') for b in allowed), sorted(allowed)[:20]
    assert any(b[:1].isalpha() for b in allowed)
    for seed in range(6):
        ids, done = random_walk(
            [g.new_matcher()], 49152, backend.vocab.token_bytes, backend.vocab.eos_ids, seed, max_steps=200
        )
        if done:
            jsonschema.validate(json.loads(backend.tokenizer.decode(ids)), schema)


def test_pattern_is_escaped_for_json(backend: GrammarBackend) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": ".*"}}, "required": ["a"]}
    g = backend.compile("json_schema", schema)
    assert not accepts(backend, g, '{"a": "x"y\\"}')
    assert accepts(backend, g, compact({"a": 'x"y\\'}))
    assert not accepts(backend, backend.compile("json_schema", schema, "xgrammar"), '{"a": "x"y\\"}')
    with pytest.raises(ValueError, match="not supported by the fsm engine"):
        backend.compile("json_schema", schema, engine="fsm")
    anchored = {"type": "string", "pattern": "^[a-z]{2}-[0-9]+$", "maxLength": 5}
    g = backend.compile("json_schema", anchored)
    for text, ok in (('"ab-1"', True), ('"ab-123"', False), ('"ab-"', False), ('"xab-1"', False)):
        assert (
            accepts(backend, g, text)
            == ok
            == jsonschema.Draft202012Validator(anchored).is_valid(json.loads(text))
        )


def test_one_of_is_exclusive(backend: GrammarBackend) -> None:
    """Exclusive by the grammar where llguidance proves it, else by a value check; never anyOf."""
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}
    g = backend.compile("json_schema", overlapping)
    assert g.checked_keywords == ["oneOf at # (as anyOf)"]
    for value in (3, -1, 2.5, -2.5, "x"):
        assert accepts(backend, g, compact(value)) == jsonschema.Draft202012Validator(overlapping).is_valid(
            value
        )
    disjoint = {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}
    g = backend.compile("json_schema", disjoint)
    for value in (3, "ab", "abcd", 2.5, None):
        assert accepts(backend, g, compact(value)) == jsonschema.Draft202012Validator(disjoint).is_valid(
            value
        )
    impossible = {
        "type": "object",
        "properties": {"r": {"type": "number"}, "w": {"type": "number"}},
        "required": ["r", "w"],
        "oneOf": [{"required": ["r"]}, {"required": ["w"]}],
    }
    with pytest.raises(ValueError, match="matches nothing"):
        backend.compile("json_schema", impossible)


def test_recursive_schema_walks_validate(backend: GrammarBackend) -> None:
    tree = {
        "$defs": {
            "T": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}, "maxItems": 2},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/T",
    }
    g = backend.compile("json_schema", tree)
    assert accepts(backend, g, compact({"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}))
    assert not accepts(backend, g, compact({"v": 1, "kids": [{"v": 12}]}))
    for seed in range(3):
        ids, done = random_walk(
            [g.new_matcher()], 49152, backend.vocab.token_bytes, backend.vocab.eos_ids, seed, max_steps=400
        )
        if done:
            jsonschema.validate(json.loads(backend.tokenizer.decode(ids)), tree)


def _subset() -> list[dict]:
    if not MASKBENCH.exists():
        pytest.skip("MaskBench development sample not present")
    with gzip.open(MASKBENCH, "rt") as f:
        return [json.loads(line)["doc"] for i, line in enumerate(f) if i % 70 == 0][:SUBSET]


def test_maskbench_subset_matches_jsonschema(backend: GrammarBackend) -> None:
    """On what compiles: a valid instance (per jsonschema) is accepted, an invalid one refused."""
    checked = 0
    for doc in _subset():
        try:
            g = backend.compile("json_schema", doc["schema"])
        except ValueError:
            continue
        cls = jsonschema.validators.validator_for(doc["schema"])
        validator = cls(doc["schema"], format_checker=cls.FORMAT_CHECKER)
        for t in doc["tests"]:
            if validator.is_valid(t["data"]) != t["valid"]:
                continue  # the label and jsonschema disagree: no independent reference
            assert accepts(backend, g, compact(t["data"])) == t["valid"], (doc["schema"], t["data"])
            checked += 1
    assert checked >= 60


def test_json_schema_error_reports_invalid_outputs() -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert json_schema_error(schema, '{"a": 1}') is None
    assert "required" in json_schema_error(schema, "{}")
    assert "not JSON" in json_schema_error(schema, '{"a": ')


def _penalized_req(prompt: list[int], tokenizer) -> SimpleNamespace:
    return SimpleNamespace(
        rid="r",
        input_ids=prompt,
        output_ids=[],
        params=SimpleNamespace(max_new_tokens=200),
        penalty_counts=torch.zeros(49152),
        penalty_seen=torch.zeros(49152, dtype=torch.bool),
        detok=SimpleNamespace(tokenizer=tokenizer),
    )


@pytest.mark.parametrize("jump", [False, True])
def test_penalty_counts_follow_output_under_jump_forward(backend: GrammarBackend, jump: bool) -> None:
    """Penalty counts always equal the token counts of the output, with or without jump-forward."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"enum": ["alpha", "beta"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,  # open, the lowest allowed token adds properties forever
    }
    fut = backend.compile_async("json_schema", schema)
    prompt = backend.tokenizer.encode('{"x', add_special_tokens=False)
    req = _penalized_req(prompt, backend.tokenizer)
    req.penalty_seen[prompt] = True
    rg = RequestGrammar(fut, backend, jump)
    rg.resolve()
    stats = SimpleNamespace(extra={})
    bitmask = torch.full((1, 1536), -1, dtype=torch.int32)
    for _ in range(200):  # bounded: a grammar that never terminates fails instead of hanging
        if rg.is_terminated():
            break
        rg.fill_next_token_bitmask(bitmask, 0)
        tok = int(allowed_ids(bitmask[0], 49152)[0])
        req.output_ids.append(tok)
        record_token(req, tok)
        rg.accept_and_jump(req, tok, stats)
        expected = torch.bincount(torch.tensor(req.output_ids), minlength=49152).float()
        assert torch.equal(req.penalty_counts, expected)
        seen = expected > 0
        seen[prompt] = True
        assert torch.equal(req.penalty_seen, seen)
    assert rg.is_terminated(), req.output_ids
    text = backend.tokenizer.decode([t for t in req.output_ids if t not in backend.stop_token_ids])
    jsonschema.validate(json.loads(text), schema)
    assert bool(stats.extra.get("jump_forward_steps")) == jump


FORMAT_SAMPLES = {
    "uri-reference": ["a/b", "http://x.com/a?b#c", "#frag", "a b", "//host/p", "%zz"],
    "uri-template": ["http://x/{a}", "/{+p*}", "{a", "x{a:3}"],
    "json-pointer": ["", "/a~0b", "/a~2"],
    "relative-json-pointer": ["0", "1/a", "01", "2#"],
    "iri": ["http://é.com", "é:x", "a"],
    "iri-reference": ["é/x", "a b"],
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_SAMPLES))
def test_regular_formats_held_by_the_grammar(backend: GrammarBackend, fmt: str) -> None:
    """Formats llguidance lacks become the grammar's regex (no value check, so no dead end), and accept
    what the format checker of the final validation accepts."""
    g = backend.compile("json_schema", {"type": "string", "format": fmt})
    assert g.checked_keywords == [] and g.dropped_keywords == []
    checker = format_checker()
    verdicts = [accepts(backend, g, json.dumps(v, ensure_ascii=False)) for v in FORMAT_SAMPLES[fmt]]
    assert verdicts == [checker.conforms(v, fmt) for v in FORMAT_SAMPLES[fmt]]
    assert True in verdicts and False in verdicts
