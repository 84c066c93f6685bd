"""Jump-forward in the scheduler hook (backend/constrained.py) without a model: after a sampled token
the forced text is appended as canonical tokens whose bytes equal it, the matcher ends in the same
state as one fed the same text token by token, the counters count the saved passes, and
max_new_tokens / disable switch / partial UTF-8 tokens are respected."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
from grammar_helpers import allowed_ids
from test_grammar_cases import default_tokenizer

from radixlm.backend.constrained import RequestGrammar
from radixlm.grammars import GrammarBackend, allocate_token_bitmask

REGEX = r'\{"name": "[a-z]{1,6}", "kind": "(cat|dog)", "legs": [0-9]\}'


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152)


def _request(backend: GrammarBackend, engine: str = "fsm", jump: bool = True, max_new: int = 64):
    fut: Future = Future()
    fut.set_result(backend.compile("regex", REGEX, engine=engine))
    grammar = RequestGrammar(fut, backend, jump)
    grammar.resolve()
    req = SimpleNamespace(
        rid="r",
        output_ids=[],
        params=SimpleNamespace(max_new_tokens=max_new),
        detok=SimpleNamespace(tokenizer=backend.tokenizer),
        penalty_counts=None,
        penalty_seen=None,
    )
    return req, grammar, SimpleNamespace(extra={})


def _step(req, grammar, stats, tok: int) -> list[int]:
    req.output_ids.append(tok)
    return grammar.accept_and_jump(req, tok, stats)


def _allowed(matcher) -> np.ndarray:
    bm = allocate_token_bitmask(1, 49152)
    matcher.fill_next_token_bitmask(bm, 0)
    return allowed_ids(bm[0], 49152)


@pytest.mark.parametrize("engine", ["fsm", "xgrammar"])
def test_jump_appends_forced_text_as_tokens(backend: GrammarBackend, engine: str) -> None:
    req, grammar, stats = _request(backend, engine)
    vocab = backend.vocab
    first = backend.tokenizer.encode("{", add_special_tokens=False)[0]
    added = _step(req, grammar, stats, first)
    text = b"".join(vocab.token_bytes[t] for t in req.output_ids).decode()
    assert text == '{"name": "' and added == req.output_ids
    assert stats.extra["jump_forward_passes_saved"] == len(added) - 1 > 0
    # canonical: the appended ids are how the tokenizer itself encodes the text
    assert req.output_ids == backend.tokenizer.encode(text, add_special_tokens=False)
    for piece in ["bob", '"']:  # the value, then the closing quote forces ', "kind": "'
        for tok in backend.tokenizer.encode(piece, add_special_tokens=False):
            _step(req, grammar, stats, tok)
    text = b"".join(vocab.token_bytes[t] for t in req.output_ids).decode()
    assert text == '{"name": "bob", "kind": "'
    reference = backend.compile("regex", REGEX, engine=engine).new_matcher()
    assert reference.accept_string(text)
    assert np.array_equal(_allowed(grammar.matcher), _allowed(reference))
    for piece in ["d", "4"]:  # 'og", "legs": ' is forced, then '}' and, at the end, the stop token
        saved = stats.extra["jump_forward_passes_saved"]
        added = _step(req, grammar, stats, backend.tokenizer.encode(piece, add_special_tokens=False)[0])
        assert stats.extra["jump_forward_passes_saved"] == saved + len(added) - 1
    eos = backend.tokenizer.eos_token_id
    assert req.output_ids[-1] == eos and grammar.is_terminated()
    text = b"".join(vocab.token_bytes[t] for t in req.output_ids[:-1]).decode()
    assert text == '{"name": "bob", "kind": "dog", "legs": 4}'


def test_no_jump_when_disabled_or_over_budget(backend: GrammarBackend) -> None:
    first = backend.tokenizer.encode("{", add_special_tokens=False)[0]
    req, grammar, stats = _request(backend, jump=False)
    assert _step(req, grammar, stats, first) == [first] and not stats.extra
    req, grammar, stats = _request(backend, max_new=2)
    assert _step(req, grammar, stats, first) == [first] and req.output_ids == [first]
    reference = backend.compile("regex", REGEX, engine="fsm").new_matcher()
    assert reference.accept_token(first)
    assert np.array_equal(_allowed(grammar.matcher), _allowed(reference))  # rolled back cleanly


def test_partial_utf8_token_kept(backend: GrammarBackend) -> None:
    g = backend.compile("regex", "日本-[0-9]", engine="fsm")
    fut: Future = Future()
    fut.set_result(g)
    grammar = RequestGrammar(fut, backend, True)
    grammar.resolve()
    req = SimpleNamespace(
        rid="r",
        output_ids=[],
        params=SimpleNamespace(max_new_tokens=32),
        detok=SimpleNamespace(tokenizer=backend.tokenizer),
        penalty_counts=None,
        penalty_seen=None,
    )
    stats = SimpleNamespace(extra={})
    byte_tok = {b: i for i, b in enumerate(backend.vocab.token_bytes) if len(b) == 1}
    first = byte_tok["日".encode()[:1]]
    assert _step(req, grammar, stats, first) == [first]  # mid-character: nothing is forced as text
    for b in "日".encode()[1:]:
        added = _step(req, grammar, stats, byte_tok[bytes([b])])
    assert added[0] == byte_tok["日".encode()[2:]]  # the token completing 日 is kept, not re-encoded
    text = b"".join(backend.vocab.token_bytes[t] for t in req.output_ids).decode()
    assert text == "日本-"
