"""Our regex FSM against xgrammar (same allowed-token set at every step of random walks) and
against re.fullmatch (every finished walk's text matches); dialect differences listed with reasons."""

from __future__ import annotations

import re

import numpy as np
import pytest
from grammar_helpers import random_walk
from test_grammar_cases import REGEXES, default_tokenizer

from radixlm.grammars import GrammarBackend

# Where the dialects differ: (regex, reason). The test checks that the difference is real.
DIALECT_DIFFERENCES = [
    (
        r"\s?[a-z]{1,5}",
        "interegular's \\s is ASCII whitespace only; xgrammar's also has Unicode spaces (U+0085, U+00A0, ...)",
    ),
]
XGRAMMAR_REJECTS = [
    (
        r"(?i:abc)",
        "group modifier flags are not supported by xgrammar (interegular expands the case variants)",
    ),
]

N_WALKS = 3


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152)


def _walks(backend: GrammarBackend, regex: str, engines: tuple[str, ...]) -> tuple[list[str], list[tuple]]:
    """Random walks driving one matcher per engine in lockstep; returns texts and mask differences."""
    grammars = [backend.compile("regex", regex, engine=e) for e in engines]
    diffs: list[tuple] = []

    def compare(allowed: list[np.ndarray]) -> None:
        for other in allowed[1:]:
            if not np.array_equal(allowed[0], other):
                a, b = set(allowed[0].tolist()), set(other.tolist())
                diffs.append((sorted(a - b)[:5], sorted(b - a)[:5]))

    texts = []
    for seed in range(N_WALKS):
        ids, finished = random_walk(
            [g.new_matcher() for g in grammars],
            backend.vocab_size,
            backend.vocab.token_bytes,
            backend.vocab.eos_ids,
            seed,
            on_step=compare,
        )
        assert finished, f"walk {seed} did not finish for {regex!r}"
        texts.append(backend.tokenizer.decode(ids, clean_up_tokenization_spaces=False))
    return texts, diffs


# '.' excludes '\n' in Python (our FSM, re.fullmatch) and not in xgrammar: the adapter rewrites it
DOT_REGEXES = [r"a.{0,8}b", r'"([^"\\]|\\.){0,20}"', r"[.x]+.\."]


@pytest.mark.parametrize("regex", REGEXES + DOT_REGEXES)
def test_fsm_equals_xgrammar_and_fullmatches(backend: GrammarBackend, regex: str) -> None:
    texts, diffs = _walks(backend, regex, ("fsm", "xgrammar"))
    assert not diffs, f"allowed sets differ (ours-only, xgrammar-only): {diffs[:3]}"
    for text in texts:
        assert re.fullmatch(regex, text), f"{text!r} does not fullmatch {regex!r}"


@pytest.mark.parametrize("regex,reason", DIALECT_DIFFERENCES)
def test_listed_dialect_differences_are_real(backend: GrammarBackend, regex: str, reason: str) -> None:
    texts, diffs = _walks(backend, regex, ("fsm", "xgrammar"))
    assert diffs, f"no difference left for {regex!r} ({reason}): move it to REGEXES"
    for text in texts:  # our side still follows Python's semantics
        assert re.fullmatch(regex, text)


@pytest.mark.parametrize("regex,reason", XGRAMMAR_REJECTS)
def test_regex_only_our_fsm_accepts(backend: GrammarBackend, regex: str, reason: str) -> None:
    with pytest.raises(ValueError):
        backend.compile("regex", regex, engine="xgrammar")
    texts, _ = _walks(backend, regex, ("fsm",))
    for text in texts:
        assert re.fullmatch(regex, text)


def test_python_dot_keeps_python_semantics() -> None:
    from radixlm.grammars.xgrammar_backend import python_dot

    cases = ["a.b", r'"([^"\\]|\\.){0,20}"', "[.]x", r"[]a.]\.", r"[^]]..", r"\\.", r"[\[].", "(a|.)*"]
    texts = ["a\nb", "axb", ".x", "]a.", "]\n\n", "[\n", "\\\n", '"\\x"', '"\\\n"']
    for regex in cases:
        for text in texts:
            assert bool(re.fullmatch(regex, text)) == bool(re.fullmatch(python_dot(regex), text)), (
                regex,
                text,
            )
    assert python_dot("a.b") == "a[^\\n]b" and python_dot("[.]") == "[.]"


@pytest.mark.parametrize(
    "regex",
    [r"b(?!c)", r"x(?=y)", r"(a(?=b))", r"a(?=b)|c", r"a(?=bc)b", r"(?=[0-9]{3})[0-9]+", r"(?=.*[A-Z]).{3}"],
)
def test_a_lookahead_that_may_read_past_the_end_is_refused(backend: GrammarBackend, regex: str) -> None:
    """interegular reads it as 'the text goes on with this' (b(?!c) would allow 'bu', not 'b')."""
    with pytest.raises(ValueError, match="lookahead that may read past the end"):
        backend.compile("regex", regex, engine="fsm")


@pytest.mark.parametrize(
    "regex", [r"a(?=b)b", r"(?=ab)a.", r"a(?!b)[a-c]", r"(?=[0-9]{3})[0-9]{3,5}", r"(?!ab)[a-c]{2}x?"]
)
def test_a_lookahead_with_pattern_after_it_is_enforced(backend: GrammarBackend, regex: str) -> None:
    texts, _ = _walks(backend, regex, ("fsm",))
    for text in texts:
        assert re.fullmatch(regex, text), f"{text!r} does not fullmatch {regex!r}"
