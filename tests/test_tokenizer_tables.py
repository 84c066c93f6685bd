"""grammars/tokenizer_tables: grammar backends over equal tokenizers share their vocabulary tables,
different tokenizers, widths or stop ids never do."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from radixlm.backend.tokenizer import load_tokenizer
from radixlm.grammars import tokenizer_tables
from radixlm.grammars.grammar_backend import GrammarBackend
from radixlm.grammars.tokenizer_tables import MAX_SHARED, shared_tables, tokenizer_fingerprint

VOCAB = 49152


def test_backends_over_equal_tokenizers_share_built_tables() -> None:
    first, second = load_tokenizer(None), load_tokenizer(None)
    assert first is not second
    a = GrammarBackend(first, VOCAB, use_disk_cache=False)
    b = GrammarBackend(second, VOCAB, use_disk_cache=False)
    assert a.tables is b.tables
    assert a.vocab is b.vocab
    assert a.llguidance is b.llguidance


def test_different_tokenizer_width_or_stops_get_their_own_tables() -> None:
    base = load_tokenizer(None)
    grown = load_tokenizer(None)
    grown.add_tokens([AddedToken("<radixlm-test-token>", special=True)])
    assert tokenizer_fingerprint(base) != tokenizer_fingerprint(grown)
    tables = shared_tables(base, VOCAB, [base.eos_token_id])
    assert shared_tables(grown, VOCAB, [base.eos_token_id]) is not tables
    assert shared_tables(base, VOCAB + 64, [base.eos_token_id]) is not tables
    assert shared_tables(base, VOCAB, [base.eos_token_id, 1]) is not tables


def test_tokenizer_without_fast_backend_is_never_shared() -> None:
    class Plain:
        eos_token_id = 0

        def __len__(self) -> int:
            return 4

    tok = Plain()
    assert tokenizer_fingerprint(tok) is None
    assert shared_tables(tok, 4, [0]) is not shared_tables(tok, 4, [0])


def test_shared_tables_keep_the_last_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_tables, "_shared", type(tokenizer_tables._shared)())
    tok = load_tokenizer(None)
    eos = tok.eos_token_id
    first = shared_tables(tok, VOCAB, [eos])
    others = [shared_tables(tok, VOCAB + 32 * (i + 1), [eos]) for i in range(MAX_SHARED - 1)]
    assert shared_tables(tok, VOCAB, [eos]) is first  # used again: now the most recent
    shared_tables(tok, VOCAB + 32 * MAX_SHARED, [eos])  # evicts the least recent, others[0]
    assert len(tokenizer_tables._shared) == MAX_SHARED
    assert shared_tables(tok, VOCAB, [eos]) is first
    assert shared_tables(tok, VOCAB + 32, [eos]) is not others[0]
