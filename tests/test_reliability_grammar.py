"""Hypothesis fuzzing of the grammar layer (issue 8): random regexes built from a small grammar of
regex constructs (some deliberately broken) and random JSON schemas (some invalid) either compile
and every random walk through the token mask that ends yields text that re.fullmatch / jsonschema
accept, or are rejected with ValueError. Never another exception, a hang (each compile is bounded
in time, each walk in steps) or an invalid output. Also: grammar size and compile-time limits."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import jsonschema
import pytest
from grammar_helpers import load_default_tokenizer, random_walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.grammars import GrammarBackend

COMPILE_LIMIT_S = 30.0
WALKS = 2
STATS: dict[str, int] = {
    "regex_tried": 0,
    "regex_rejected": 0,
    "regex_walks_checked": 0,
    "schema_tried": 0,
    "schema_rejected": 0,
    "schema_walks_checked": 0,
}


@pytest.fixture(scope="module")
def backend() -> Any:
    tok = load_default_tokenizer()
    be = GrammarBackend(tok, 49152, use_disk_cache=False)
    yield be
    be.shutdown()
    print(f"\n[reliability] grammar_fuzz: {json.dumps(STATS)}")


# ---------------------------------------------------------------- strategies

_ATOMS = st.sampled_from(
    [
        "a",
        "b",
        "z",
        "0",
        "7",
        " ",
        "-",
        "\\.",
        "\\d",
        "[a-c]",
        "[0-9]",
        "[^a-y\\n]",
        "\\w",
        "[xyz]",
        ".",
        "(ab|cd)",
        "\\(",
        "é",
    ]
)
_BROKEN = st.sampled_from(["(", ")", "[", "*", "a{3,1}", "\\", "+a", "[z-a]", "(?<", "a**"])


def _quantify(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    quant = st.sampled_from(["?", "*", "+", "{2}", "{1,3}", "{0,2}"])
    return st.tuples(inner, quant).map(lambda t: f"(?:{t[0]}){t[1]}" if len(t[0]) > 1 else t[0] + t[1])


REGEXES = st.recursive(
    _ATOMS,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        _quantify(inner),
    ),
    max_leaves=6,
)
MAYBE_BROKEN_REGEXES = st.one_of(
    REGEXES, st.tuples(REGEXES, _BROKEN, st.booleans()).map(lambda t: t[0] + t[1] if t[2] else t[1] + t[0])
)

_LEAF_SCHEMAS = st.one_of(
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", 3, None, True]), min_size=1, max_size=3, unique=True).map(
        lambda xs: {"enum": xs}
    ),
    st.sampled_from(["[a-z]{1,4}", "\\d{3}", "(yes|no)"]).map(lambda p: {"type": "string", "pattern": p}),
)
_NAMES = st.sampled_from(["a", "id", "name", "tags", "x_y"])


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    props = st.dictionaries(_NAMES, children, min_size=1, max_size=3)
    return st.tuples(props, st.integers(0, 3)).map(
        lambda t: {
            "type": "object",
            "properties": t[0],
            "required": sorted(t[0])[: t[1]],
            "additionalProperties": False,
        }
    )


SCHEMAS = st.recursive(
    _LEAF_SCHEMAS,
    lambda inner: st.one_of(
        _object(inner),
        st.tuples(inner, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
    ),
    max_leaves=5,
)
BAD_SCHEMAS = st.sampled_from(
    [
        {"type": "nonsense"},
        {"type": "integer", "minimum": "five"},
        {"type": "object", "properties": 3},
        {"type": "string", "pattern": "(unclosed"},
        {"type": "array", "items": {"type": 7}},
        {"enum": []},
    ]
)


# ---------------------------------------------------------------- checks


def _compile(backend: GrammarBackend, kind: str, spec: Any) -> Any | None:
    """The compiled grammar, or None when rejected with ValueError; fails on anything else."""
    t0 = time.monotonic()
    try:
        return backend.compile_async(kind, spec).result(timeout=COMPILE_LIMIT_S)
    except ValueError as e:
        assert str(e), "ValueError without a reason"
        return None
    except FutureTimeout:
        pytest.fail(f"compile of {kind} {spec!r} hung (> {COMPILE_LIMIT_S} s)")
    finally:
        assert time.monotonic() - t0 < COMPILE_LIMIT_S + 5


def _walk_texts(backend: GrammarBackend, grammar: Any, seed: int) -> list[str]:
    """Texts of the random walks that reached EOS (each walk bounded to 80 tokens)."""
    texts = []
    for k in range(WALKS):
        ids, done = random_walk(
            [grammar.new_matcher()],
            backend.vocab_size,
            backend.vocab.token_bytes,
            backend.stop_token_ids,
            seed=seed * 7 + k,
            max_steps=80,
        )
        if done:
            texts.append(b"".join(backend.vocab.token_bytes[i] for i in ids).decode("utf-8"))
    return texts


_FUZZ = settings(
    max_examples=30, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


@_FUZZ
@given(regex=MAYBE_BROKEN_REGEXES, seed=st.integers(0, 1000))
def test_random_regexes_compile_validly_or_raise_value_error(
    backend: GrammarBackend, regex: str, seed: int
) -> None:
    STATS["regex_tried"] += 1
    grammar = _compile(backend, "regex", regex)
    if grammar is None:
        STATS["regex_rejected"] += 1
        return
    try:
        python_re = re.compile(regex)  # anything we accept, Python's re must accept too
    except re.error as e:
        pytest.fail(f"compiled {regex!r}, which Python's re rejects: {e}")
    for text in _walk_texts(backend, grammar, seed):
        STATS["regex_walks_checked"] += 1
        assert python_re.fullmatch(text), (regex, text)


@_FUZZ
@given(schema=st.one_of(SCHEMAS, SCHEMAS, BAD_SCHEMAS), seed=st.integers(0, 1000))
def test_random_json_schemas_compile_validly_or_raise_value_error(
    backend: GrammarBackend, schema: dict, seed: int
) -> None:
    STATS["schema_tried"] += 1
    grammar = _compile(backend, "json_schema", schema)
    if grammar is None:
        STATS["schema_rejected"] += 1
        return
    jsonschema.Draft202012Validator.check_schema(schema)  # accepted schemas are valid schemas
    for text in _walk_texts(backend, grammar, seed):
        STATS["schema_walks_checked"] += 1
        jsonschema.validate(json.loads(text), schema)


def test_grammar_size_and_compile_time_limits(backend: GrammarBackend) -> None:
    small = GrammarBackend(backend.tokenizer, 49152, max_states=50, use_disk_cache=False)
    slow = GrammarBackend(backend.tokenizer, 49152, compile_timeout_s=0.0, use_disk_cache=False)
    try:
        with pytest.raises(ValueError, match="too large"):
            small.compile("regex", "[a-z]{60}")
        with pytest.raises(ValueError, match="timeout"):
            slow.compile("regex", "[a-zé]{1,40}")
        with pytest.raises(ValueError, match="too large"):
            backend.compile("regex", "[a-z]{20000}")
    finally:
        small.shutdown()
        slow.shutdown()
