"""Value checks (grammars/schema_guard.py, json_tracker.py, guard_mask.py) against jsonschema: for schemas
whose keywords only a check holds, a document is accepted exactly when jsonschema says it is valid,
and every token of a valid document is inside the mask;
the JSON reader alone reports the same verdicts under random byte chunking."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import jsonschema
import pytest
import torch
from grammar_helpers import allowed_ids
from test_grammar_cases import default_tokenizer

from radixlm.grammars import GrammarBackend
from radixlm.grammars.guard_mask import candidate_ids
from radixlm.grammars.json_tracker import JsonTracker
from radixlm.grammars.schema_guard import GuardPlan, verdict_validator

CASES: list[tuple[dict, list]] = [
    (
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        [["a", "b"], ["a", "a"], [], ["x", "y", "x"], ["é", "e"]],
    ),
    (
        {"type": "array", "items": {"type": "object"}, "uniqueItems": True},
        [[{"a": 1}, {"a": 2}], [{"a": 1}, {"a": 1.0}], [{}, {"b": [1]}], [{"b": [1]}, {"b": [1]}]],
    ),
    (
        {
            "type": "object",
            "properties": {
                "tags": {"$ref": "#/$defs/tags"},
                "n": {"type": "integer", "not": {"multipleOf": 3}},
                "s": {"type": "string", "not": {"pattern": "^x"}},
            },
            "$defs": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        },
        [
            {"tags": [1, 2]},
            {"tags": [1, 1]},
            {"n": 4},
            {"n": 6},
            {"s": "ax"},
            {"s": "xa"},
            {"n": 10, "s": "b"},
        ],
    ),
    (
        {
            "type": "object",
            "properties": {"kind": {"type": "string"}, "size": {"type": "integer"}},
            "if": {"properties": {"kind": {"const": "big"}}, "required": ["kind"]},
            "then": {"properties": {"size": {"minimum": 10}}, "required": ["size"]},
        },
        [
            {"kind": "big", "size": 12},
            {"kind": "big", "size": 2},
            {"kind": "big"},
            {"kind": "small", "size": 2},
        ],
    ),
    (
        {"type": "object", "additionalProperties": {"type": "array", "uniqueItems": True}},
        [
            {"a": [1, 2], "b": [True, 1]},
            {"a": [[1], [1]]},
            {"a": [None, None]},
            {},
            {"a": [1, 1.0]},
            {"a": [False, 0, None, "0", [0], {"0": 0}]},
            {"a": [1, [1], 2, [1]]},
            {"a": ["x", {"k": 1}, "x"]},
            {"a": [{"k": 1}, "k", {"k": 1.0}]},
        ],
    ),
    (
        {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}},
        [{"ab": 1}, {"abc": 1}, {"a": 1, "b": 2}],
    ),
    (
        {
            "allOf": [
                {"type": "object"},
                {"properties": {"v": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}}},
            ]
        },
        [{"v": -1}, {"v": 1}, {"v": 2.5}, {"v": "s"}],
    ),
]


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152, use_disk_cache=False)


def _walk(backend: GrammarBackend, grammar, text: str) -> tuple[bool, bool]:
    """(accepted, every token inside the mask) for text then a stop token."""
    m = grammar.new_matcher()
    bitmask = torch.zeros((1, 1536), dtype=torch.int32)
    in_mask = True
    for t in [*backend.tokenizer.encode(text, add_special_tokens=False), backend.stop_token_ids[0]]:
        m.fill_next_token_bitmask(bitmask, 0)
        in_mask = in_mask and t in set(allowed_ids(bitmask[0], 49152).tolist())
        if not m.accept_token(t):
            return False, in_mask
    return m.is_terminated(), in_mask


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matcher_verdicts_equal_jsonschema(backend: GrammarBackend, case: int) -> None:
    schema, values = CASES[case]
    grammar = backend.compile("json_schema", schema)
    assert grammar.checked_keywords, "the case should need a value check"
    validator = jsonschema.Draft202012Validator(schema)
    verdicts = []
    for value in values:
        valid = validator.is_valid(value)
        verdicts.append(valid)
        text = json.dumps(value, separators=(", ", ": "), ensure_ascii=False)  # the grammar's whitespace
        accepted, in_mask = _walk(backend, grammar, text)
        assert accepted == valid, value
        assert in_mask or not valid, value
    assert True in verdicts and False in verdicts


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reader_verdicts_under_random_chunking(backend: GrammarBackend, case: int) -> None:
    schema, values = CASES[case]
    plan = backend.compile("json_schema", schema).plan
    assert plan is not None
    rng = random.Random(case)
    validator = jsonschema.Draft202012Validator(schema)
    for value in values:
        data = json.dumps(value, ensure_ascii=False).encode()
        for _ in range(4):
            tracker, buf, ok, i = JsonTracker(plan.root), bytearray(), True, 0
            while ok and i < len(data):
                chunk = data[i : i + rng.randint(1, 5)]
                ok = tracker.feed(chunk, buf)
                buf += chunk
                i += len(chunk)
            ok = ok and tracker.finish(buf)
            if not ok:  # a check refused: the value breaks a checked keyword
                assert not validator.is_valid(value), value


@pytest.mark.parametrize("case", range(len(CASES)))
def test_candidate_filter_misses_no_refused_token(backend: GrammarBackend, case: int) -> None:
    """At every step of the cases' documents, each grammar-allowed token that a check refuses (tried
    one by one on the reader) is among the tokens the mask refinement tries."""
    schema, values = CASES[case]
    grammar = backend.compile("json_schema", schema)
    features = grammar.features
    bitmask = torch.zeros((1, 1536), dtype=torch.int32)
    for value in values:
        m = grammar.new_matcher()
        for t in backend.tokenizer.encode(compact(value), add_special_tokens=False):
            m._m.fill_next_token_bitmask(bitmask, 0)  # the grammar's mask, before the refinement
            tracker, buf = m._tracker, m._buf
            refused = {
                int(u)
                for u in allowed_ids(bitmask[0], 49152)
                if u not in features.stop_ids and not tracker.copy().feed(features.token_bytes[u], buf)
            }
            tried = candidate_ids(tracker, features)
            assert refused <= set(() if tried is None else tried.tolist()), (value, refused)
            if not m.accept_token(t):
                break


def compact(value: object) -> str:
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


def test_tokens_that_are_not_json_are_refused_not_raised(backend: GrammarBackend) -> None:
    """The reader sees a token before the grammar judges it: a stray close or a bad key refuses."""
    grammar = backend.compile("json_schema", CASES[5][0])
    m = grammar.new_matcher()
    assert not m.accept_token(backend.tokenizer.encode("}", add_special_tokens=False)[0])
    tracker = m._tracker.copy()
    assert not tracker.feed(b"]", b"")
    assert not m._tracker.copy().feed(b'{"\\x": 1}', b"")


VERDICT_SCHEMAS: list[tuple[dict, list]] = [
    (
        {"oneOf": [{"type": "integer"}, {"minimum": 2}, {"type": "string"}]},
        [1, 2, 3, 1.5, "a", None, [], {"a": 1}],
    ),
    (
        {
            "anyOf": [
                {
                    "type": "object",
                    "required": ["a"],
                    "properties": {"a": {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}},
                },
                {
                    "type": "array",
                    "items": {"anyOf": [{"type": "string", "pattern": "^x"}, {"type": "null"}]},
                },
            ]
        },
        [{"a": 1}, {"a": 2}, {"a": 3}, {}, ["xa", None], ["y"], [], 5],
    ),
    ({"$defs": {"p": {"oneOf": [{"multipleOf": 2}, {"multipleOf": 3}]}}, "$ref": "#/$defs/p"}, [2, 3, 6, 5]),
]


@pytest.mark.parametrize("draft", [jsonschema.Draft7Validator, jsonschema.Draft202012Validator])
@pytest.mark.parametrize("schema,values", VERDICT_SCHEMAS)
def test_verdict_validator_agrees_with_jsonschema(draft, schema, values) -> None:
    """anyOf / oneOf that stop at a branch's first error give jsonschema's own verdict on every value."""
    from radixlm.grammars.schema_guard import verdict_validator

    fast, full = verdict_validator(draft)(schema), draft(schema)
    verdicts = [fast.is_valid(v) for v in values]
    assert verdicts == [full.is_valid(v) for v in values]
    assert True in verdicts and False in verdicts  # each case tells valid from invalid
    assert type(fast) is not draft and verdict_validator(draft) is type(fast)  # extended once, cached


@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("vocab", [32, 97, 49152])
def test_guard_allowed_ids_equal_a_full_unpack(density: float, vocab: int) -> None:
    """The guard's id listing (non-zero words only) equals unpacking every bit, padding bits past
    the vocabulary included in the row and left out of the answer."""
    from radixlm.grammars.guard_mask import allowed_ids as guard_allowed_ids

    rng = random.Random(int(density * 1000) + vocab)
    words = (vocab + 31) // 32 + 1
    bits = [1 if rng.random() < density else 0 for _ in range(words * 32)]
    packed = [sum(bits[w * 32 + i] << i for i in range(32)) for w in range(words)]
    row = torch.tensor([p - (1 << 32) if p >= 1 << 31 else p for p in packed], dtype=torch.int32)
    got = guard_allowed_ids(row, vocab)
    assert got.tolist() == allowed_ids(row, vocab).tolist()
    assert got.tolist() == [i for i in range(vocab) if bits[i]]


def test_scalar_key_of_a_string_equals_json_loads() -> None:
    """The unescaped-string fast path gives json.loads' value and refuses what it refuses (invalid
    UTF-8, raw control characters), surrogates included."""
    from radixlm.grammars.schema_guard import _NO_VALUE, _scalar_key

    rng = random.Random(5)
    alphabet = [b"a", b"\\", b'"', b"\x01", b"\xc3\xa9", b"\xff", b"\xed\xa0\x80", b"n", b"u", b" ", b"0"]
    texts = [
        b'"' + b"".join(rng.choice(alphabet) for _ in range(rng.randrange(4))) + b'"' for _ in range(3000)
    ]
    for text in texts:
        try:
            value = json.loads(text)
            want = ("string", value) if isinstance(value, str) else "other"
        except ValueError:
            want = _NO_VALUE
        got = _scalar_key.__wrapped__(text)
        assert got == want or (got is _NO_VALUE and want is _NO_VALUE), text


@pytest.mark.parametrize(
    "schema, text",
    [
        (
            {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            '["", "ab", "a", "abc", "b c", "x\\"y"]',
        ),
        (
            {"type": "object", "properties": {"s": {"type": "string", "format": "regex"}}},
            '{"s": "a(b)", "t": 1}',
        ),
        ({"type": "string", "if": {"maxLength": 2}, "then": {"pattern": "a"}}, '"xbc"'),
        (
            {"type": "array", "items": {"type": "array", "items": {"type": "string"}}, "uniqueItems": True},
            '[["name"], ["x"], ["name1", "y"]]',
        ),
        (
            {
                "type": "object",
                "propertyNames": {"pattern": "^(?!name$)"},
                "additionalProperties": {"type": "integer"},
            },
            '{"ab": 1, "name1": 2, "e": 3}',
        ),
    ],
)
def test_string_end_verdicts_equal_a_full_feed(
    backend: GrammarBackend, schema: dict, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Candidate tokens that close the open string (a value or a key) and complete nothing after it
    are judged without copying the reader: at every position the mask equals the one a full feed
    of every candidate gives."""
    _assert_same_masks(
        backend, schema, text, monkeypatch, "_judge_string_ends", lambda tracker, ids, *_: ([], ids)
    )


@pytest.mark.parametrize(
    "schema, text",
    [
        (
            {"type": "array", "items": {"type": ["boolean", "null", "number"]}, "uniqueItems": True},
            "[true, null, -1.5e3, 1, false]",
        ),
        (
            {"type": "array", "items": {"enum": [1, 12, 123, True, None]}, "uniqueItems": True},
            "[12, true, 1, null]",
        ),
    ],
)
def test_open_scalar_shortcut_keeps_the_masks_of_the_full_lookahead(
    backend: GrammarBackend, schema: dict, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token that leaves a number or literal that cannot end yet is kept without probing the
    grammar's next tokens: at every position of the walk the mask equals the one the full
    one-token lookahead gives."""
    _assert_same_masks(backend, schema, text, monkeypatch, "_incomplete_scalar", lambda *_: False)


@pytest.mark.parametrize(
    "schema, text",
    [
        (
            {"type": "array", "items": {"type": ["boolean", "null", "number", "array"]}, "uniqueItems": True},
            "[true, null, -1.5e3, [], 1, false, [1]]",
        ),
    ],
)
def test_tokens_equal_after_leading_whitespace_share_one_verdict(
    backend: GrammarBackend, schema: dict, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between values, a candidate token is judged once per form without its leading whitespace: at
    every position the mask equals the one judging every token on its own."""
    _assert_same_masks(backend, schema, text, monkeypatch, "_verdict_key", lambda tracker, data: data)


def _assert_same_masks(
    backend: GrammarBackend,
    schema: dict,
    text: str,
    monkeypatch: pytest.MonkeyPatch,
    shortcut: str,
    off: Callable[..., object],
) -> None:
    """The masks along text's tokens, with guard_mask's shortcut on and then replaced by off (the
    full path), are equal; the shortcut was taken at least once (it returned something other than
    what off returns for the same arguments)."""
    import radixlm.grammars.guard_mask as guard_mask

    grammar = backend.compile("json_schema", json.dumps(schema), "auto", strict=True)
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    taken = []
    real = getattr(guard_mask, shortcut)

    def counted(*args: object) -> object:
        result = real(*args)
        taken.append(result != off(*args))
        return result

    def masks() -> list[list[int]]:
        m, bitmask, out = grammar.new_matcher(), torch.zeros((1, 1536), dtype=torch.int32), []
        for t in ids:
            m.fill_next_token_bitmask(bitmask, 0)
            out.append(allowed_ids(bitmask[0], 49152).tolist())
            assert m.accept_token(t)
        return out

    monkeypatch.setattr(guard_mask, shortcut, counted)
    fast = masks()
    assert any(taken)
    monkeypatch.setattr(guard_mask, shortcut, off)
    assert fast == masks()


def _guard_plan(schema: dict, checked: list[dict]) -> GuardPlan:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return GuardPlan(schema, {id(n): {"not"} for n in checked}, verdict_validator(cls)(schema))


def test_a_check_that_another_check_at_the_location_validates_is_dropped() -> None:
    """An allOf member (or $ref target) is validated with its parent: only the parent is checked.
    Beside a $ref, drafts up to 7 ignore allOf, so there the member keeps its own check."""
    member = {"not": {"const": 1}}
    modern = {"allOf": [member], "not": {"const": 2}}
    plan = _guard_plan(modern, [modern, member])
    assert plan.root.check_nodes == [modern]
    assert [plan.root.check_value(t) for t in (b"1", b"2", b"3")] == [False, False, True]

    target = {"not": {"const": 2}}
    legacy = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"t": target},
        "$ref": "#/definitions/t",
        "allOf": [member],
    }
    plan = _guard_plan(legacy, [legacy, member, target])
    assert [id(n) for n in plan.root.check_nodes] == [id(legacy), id(member)]
    assert [plan.root.check_value(t) for t in (b"1", b"2", b"3")] == [False, False, True]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "propertyNames": {"pattern": "\\p{Lu}"}},
        {"type": "object", "patternProperties": {"\\p{L}": {"type": "integer"}, "^a": {"type": "string"}}},
    ],
)
def test_a_checked_schema_with_a_pattern_python_cannot_compile_is_refused_at_compile(
    backend: GrammarBackend, schema: dict
) -> None:
    """The value checks read patterns with Python's re: a pattern it cannot compile is refused when
    the grammar is compiled (a 400), never raised later from inside a decoding step."""
    with pytest.raises(ValueError, match=r"does not compile with Python's re"):
        backend.compile("json_schema", json.dumps(schema))
