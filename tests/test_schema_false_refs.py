"""A `$ref` to a definition that matches nothing: llguidance refused the whole schema even where the
reference is optional; now the reference becomes `false` (the same language), so the schema
compiles, the property is forbidden, jsonschema agrees on every document tried, and a required
reference is still refused."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend
from radixlm.grammars.schema_false_refs import refs_to_false, unsatisfiable_pointer

NOTHING = {"type": "object", "oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"$ref": "#/definitions/Nothing"}, "n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
    "definitions": {"Nothing": NOTHING},
}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152)


def test_error_names_the_definition_and_only_its_refs_change():
    err = "Unsatisfiable schema: incompatible types\n  while processing json-schema:///#/definitions/Nothing)"
    assert unsatisfiable_pointer(err) == ("json-schema:///", "#/definitions/Nothing")
    assert unsatisfiable_pointer("Unsatisfiable schema: required property 'a' is unsatisfiable") is None
    out = json.loads(refs_to_false(json.dumps(SCHEMA), "json-schema:///", "#/definitions/Nothing") or "")
    assert out["properties"]["kind"] is False and out["properties"]["n"] == {"type": "integer"}
    assert out["definitions"] == SCHEMA["definitions"]
    based = {**SCHEMA, "id": "https://x.example/s.json"}
    based["properties"] = {"kind": {"$ref": "https://x.example/s.json#/definitions/Nothing"}}
    out = json.loads(
        refs_to_false(json.dumps(based), "https://x.example/s.json", "#/definitions/Nothing") or ""
    )
    assert out["properties"]["kind"] is False
    assert refs_to_false(json.dumps(SCHEMA), "json-schema:///", "#/definitions/Other") is None


def _accepts(backend: GrammarBackend, compiled, doc: dict) -> bool:
    m = compiled.new_matcher()
    text = json.dumps(doc, separators=(", ", ": "))
    return m.accept_string(text) and m.accept_token(backend.tokenizer.eos_token_id) and m.is_terminated()


def test_optional_ref_to_nothing_compiles_and_forbids_the_property(backend: GrammarBackend):
    compiled = backend.compile("json_schema", json.dumps(SCHEMA), "auto", True)
    for doc in ({"n": 3}, {"n": 3, "kind": "abc"}, {"n": 3, "kind": {}}, {"kind": "a"}):
        expected = jsonschema.Draft7Validator(SCHEMA).is_valid(doc)
        assert _accepts(backend, compiled, doc) == expected, doc
    assert _accepts(backend, compiled, {"n": 3})


def test_required_ref_to_nothing_is_still_refused(backend: GrammarBackend):
    schema = {**SCHEMA, "required": ["n", "kind"]}
    with pytest.raises(ValueError, match="matches nothing"):
        backend.compile("json_schema", json.dumps(schema), "auto", True)
