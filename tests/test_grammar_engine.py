"""Constrained decoding end to end on the default model (CPU, temperature 1.0): every output
re.fullmatch-es its regex / validates against its JSON schema through our FSM and xgrammar;
jump-forward on vs off are both valid and on takes fewer forward passes; bad grammars raise
ValueError before any forward pass and the engine keeps serving."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from test_grammar_cases import REGEXES, SCHEMAS

from radixlm.backend.request import GRAMMAR_DEAD_END

SAMPLES = 3
PROMPT = "Answer in the requested format.\n"
# Open-ended repetition (+, *, strings without maxLength, maps) may run past max_new_tokens at
# temperature 1.0 on a 135M model: the output is then cut, not wrong. The end-to-end sets keep the
# bounded cases (the random-walk tests cover all of them).
BOUNDED_REGEXES = [r for r in REGEXES if not re.search(r"(?<!\\)[+*]", r.replace("[+-]", ""))]


def _unbounded(schema: object) -> bool:
    if isinstance(schema, list):
        return any(_unbounded(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string" and not {"maxLength", "format", "pattern"} & set(schema):
        return True
    if isinstance(schema.get("additionalProperties"), dict):
        return True
    return any(_unbounded(v) for v in schema.values())


def _closed(schema: object) -> object:
    """The schema with every object that is silent about undeclared properties closed: an open
    object lets a sampler at temperature 1.0 add properties past max_new_tokens."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and not {"additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


BOUNDED_SCHEMAS = [_closed(s) for s in SCHEMAS if not _unbounded(s)]


@pytest.fixture
def grammar_engine(engine):
    """The session engine with its grammar settings restored after each test."""
    saved = engine.disable_jump_forward, getattr(engine, "grammar_engine", "auto")
    yield engine
    engine.disable_jump_forward, engine.grammar_engine = saved


def _generate(engine, params: list[dict]) -> list[dict]:
    outs = engine.generate([PROMPT] * len(params), params)
    return outs if isinstance(outs, list) else [outs]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["auto", "xgrammar"])
def test_outputs_fullmatch_and_validate(grammar_engine, which: str) -> None:
    """≥ 30 regexes and ≥ 30 schemas, SAMPLES each, in one batch per grammar engine ("auto" = our FSM
    for regexes and for these schemas)."""
    assert len(BOUNDED_REGEXES) >= 30 and len(BOUNDED_SCHEMAS) >= 30
    grammar_engine.grammar_engine = which
    params = [
        {"regex": r, "temperature": 1.0, "max_new_tokens": 96, "seed": k}
        for r in BOUNDED_REGEXES
        for k in range(SAMPLES)
    ]
    params += [
        {"json_schema": s, "temperature": 1.0, "max_new_tokens": 160, "seed": k}
        for s in BOUNDED_SCHEMAS
        for k in range(SAMPLES)
    ]
    for p, out in zip(params, _generate(grammar_engine, params)):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (p, out)
        if "regex" in p:
            assert re.fullmatch(p["regex"], out["text"]), (p["regex"], out["text"])
        else:
            jsonschema.validate(json.loads(out["text"]), p["json_schema"])


HEAVY_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 10},
        "shipping_address_city": {"enum": ["Paris", "Rome", "Oslo"]},
        "number_of_items_ordered": {"type": "integer"},
        "is_express_delivery_requested": {"type": "boolean"},
    },
    "required": [
        "customer_full_name",
        "shipping_address_city",
        "number_of_items_ordered",
        "is_express_delivery_requested",
    ],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_jump_forward_on_vs_off(grammar_engine) -> None:
    params = [
        {"json_schema": HEAVY_SCHEMA, "temperature": 1.0, "max_new_tokens": 100, "seed": k} for k in range(2)
    ]
    passes, outs = {}, {}
    for jf in (False, True):
        grammar_engine.disable_jump_forward = not jf
        before = grammar_engine.get_stats()
        outs[jf] = _generate(grammar_engine, params)
        after = grammar_engine.get_stats()
        passes[jf] = after["forward_passes"] - before["forward_passes"]
        saved = after.get("jump_forward_passes_saved", 0) - before.get("jump_forward_passes_saved", 0)
        assert (saved > 0) == jf
        for out in outs[jf]:
            jsonschema.validate(json.loads(out["text"]), HEAVY_SCHEMA)
    assert passes[True] < passes[False], passes
    # the same output length costs fewer passes: forced keys/punctuation went through extend steps
    tokens = {jf: sum(o["meta_info"]["completion_tokens"] for o in outs[jf]) for jf in outs}
    assert passes[True] / tokens[True] < passes[False] / tokens[False]


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({"regex": "("}, "invalid or unsupported regex"),
        ({"regex": "(?=a)b"}, "matches no string"),
        ({"json_schema": '{"type": '}, "not valid JSON"),
        ({"json_schema": {"$ref": "https://example.com/s.json"}}, "external reference"),
        ({"json_schema": {"type": "object", "not": {}}}, "matches nothing"),
        ({"regex": "[a-z]{1,20000}"}, "grammar too large"),
        ({"ebnf": "root ::= undefined_rule"}, "invalid ebnf"),
        ({"regex": "a", "json_schema": {"type": "integer"}}, "only one of"),
    ],
)
def test_bad_grammar_rejected_before_forward(grammar_engine, params: dict, fragment: str) -> None:
    before = grammar_engine.get_stats()["forward_passes"]
    with pytest.raises(ValueError, match=re.escape(fragment)):
        grammar_engine.generate(PROMPT, {**params, "max_new_tokens": 8})
    assert grammar_engine.get_stats()["forward_passes"] == before
    out = grammar_engine.generate(PROMPT, {"regex": "(yes|no)", "max_new_tokens": 8})
    assert out["text"] in ("yes", "no")


def test_value_checked_keywords_in_generation(grammar_engine) -> None:
    """uniqueItems and not, held by value checks, in sampled outputs; a schema whose grammar allows a
    document no check accepts ends as a reported dead end, never as a valid output."""
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}},
        "uniqueItems": True,
        "minItems": 3,
        "maxItems": 4,
    }
    params = {"json_schema": schema, "max_new_tokens": 40, "temperature": 1.0, "seed": 0}
    outs = _generate(grammar_engine, [{**params, "seed": k} for k in range(4)])
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        jsonschema.validate(json.loads(out["text"]), schema)
        assert out["meta_info"]["json_schema_valid"] is True
        assert out["meta_info"]["grammar_checked_keywords"] == ["uniqueItems at #"]
    dead = {
        "type": "object",
        "properties": {"a": {"const": 1}},
        "required": ["a"],
        "additionalProperties": False,
        "if": {"required": ["a"]},
        "then": {"required": ["b"]},
    }
    out = grammar_engine.generate(PROMPT, {"json_schema": dead, "max_new_tokens": 40})
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": GRAMMAR_DEAD_END}
    assert out["meta_info"]["json_schema_valid"] is False


def test_ebnf_pydantic_stream_and_async(grammar_engine) -> None:
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=8)
        legs: int

    out = grammar_engine.generate(PROMPT, {"ebnf": 'root ::= "yes" | "no" | "maybe"', "temperature": 1.0})
    assert out["text"] in ("yes", "no", "maybe")
    chunks = list(
        grammar_engine.generate(
            PROMPT, {"json_schema": Pet, "temperature": 1.0, "max_new_tokens": 64}, stream=True
        )
    )
    Pet.model_validate_json("".join(c["text"] for c in chunks))

    async def run() -> list[dict]:
        return await asyncio.gather(
            *[
                grammar_engine.async_generate(
                    PROMPT, {"regex": r"[0-9]{3}-[a-z]{2}", "temperature": 1.0, "seed": k}
                )
                for k in range(3)
            ]
        )

    for res in asyncio.run(run()):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", res["text"])


def test_mask_pool_threads_are_a_quarter_of_the_cpus_up_to_four() -> None:
    from radixlm.grammars.masking import mask_threads

    assert [mask_threads(n) for n in (1, 2, 4, 8, 15, 16, 64, 192)] == [1, 1, 1, 2, 3, 4, 4, 4]
