"""Our FSM's promises beyond mask equality: EOS only in accepting states, special tokens never,
UTF-8 split across tokens, jump-forward strings, rollback/accept_string, the disk cache, error
cases, SentencePiece byte-fallback vocabularies, vocab_size wider than the tokenizer."""

from __future__ import annotations

import os
import re
import threading

import numpy as np
import pytest
from grammar_helpers import allowed_ids, random_walk
from test_grammar_cases import default_tokenizer
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from radixlm.grammars import GrammarBackend, allocate_token_bitmask
from radixlm.grammars.fsm import compile_regex
from radixlm.grammars.token_index import vocab_from_tokenizer


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(default_tokenizer(), 49152)


def _allowed(matcher, vocab_size: int) -> np.ndarray:
    bm = allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bm, 0)
    return allowed_ids(bm[0], vocab_size)


def _ids(backend: GrammarBackend, text: str) -> list[int]:
    return backend.tokenizer.encode(text, add_special_tokens=False)


def test_eos_only_in_accepting_states_and_specials_never(backend: GrammarBackend) -> None:
    g = backend.compile("regex", r"ab(c|de)?", engine="fsm")
    specials = set(backend.tokenizer.all_special_ids) - set(backend.vocab.eos_ids)
    m = g.new_matcher()
    seen_states = 0
    for text, accepting in [("", False), ("a", False), ("b", True), ("d", False), ("e", True)]:
        if text:
            assert m.accept_token(_ids(backend, text)[0])
        allowed = set(_allowed(m, 49152).tolist())
        assert (backend.tokenizer.eos_token_id in allowed) == accepting
        assert not allowed & specials
        assert m.accept_token(backend.tokenizer.eos_token_id) == accepting
        if accepting:
            m.rollback(1)
        seen_states += 1
    assert m.accept_token(backend.tokenizer.eos_token_id) and m.is_terminated()
    assert not m.accept_token(_ids(backend, "a")[0])
    assert set(_allowed(m, 49152).tolist()) == {backend.tokenizer.eos_token_id}


def test_multibyte_char_split_across_byte_tokens(backend: GrammarBackend) -> None:
    g = backend.compile("regex", "(日本|é)x", engine="fsm")
    m = g.new_matcher()
    byte_token = {b: i for i, b in enumerate(backend.vocab.token_bytes) if len(b) == 1}
    token_byte = {i: b for b, i in byte_token.items()}
    data = "日本".encode()
    for j in range(len(data)):
        allowed_single = {token_byte[i] for i in _allowed(m, 49152).tolist() if i in token_byte}
        expected = {b"\xe6", b"\xc3"} if j == 0 else {data[j : j + 1]}  # 日 = e6 97 a5, é = c3 a9
        assert allowed_single == expected
        assert m.accept_token(byte_token[data[j : j + 1]])
    assert m.find_jump_forward_string() == "x"


def test_jump_forward_strings_and_rollback(backend: GrammarBackend) -> None:
    g = backend.compile("regex", r'\{"name": "[a-z]{1,4}", "age": [0-9]\}', engine="fsm")
    m = g.new_matcher()
    assert m.find_jump_forward_string() == '{"name": "'
    assert m.accept_string('{"name": "')
    assert m.find_jump_forward_string() == ""
    assert m.accept_token(_ids(backend, "bob")[0])
    state_before = set(_allowed(m, 49152).tolist())
    assert not m.accept_string('", "agX')  # rejected: state unchanged
    assert m.accept_string('"')
    assert m.find_jump_forward_string() == ', "age": '
    m.rollback(1)
    assert set(_allowed(m, 49152).tolist()) == state_before
    m.rollback(2)
    assert m.find_jump_forward_string() == '{"name": "'
    with pytest.raises(ValueError):
        m.rollback(1)


def test_jump_forward_equals_xgrammar_on_literal_chains(backend: GrammarBackend) -> None:
    regex = r'\{"id": [0-9]{2}, "kind": "(cat|dog)"\}'
    ours, theirs = (backend.compile("regex", regex, engine=e).new_matcher() for e in ("fsm", "xgrammar"))
    for piece in ['{"id": ', "4", "2", ', "kind": "', "d", 'og"}']:
        assert ours.find_jump_forward_string() == theirs.find_jump_forward_string()
        assert ours.accept_string(piece) and theirs.accept_string(piece)


def test_disk_cache_roundtrip_and_corruption(backend: GrammarBackend, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    regex = r"[a-c]{2}-(x|yz)"
    fresh = compile_regex(regex, backend.vocab)
    files = list((tmp_path / "fsm").glob("*.npz"))
    assert len(files) == 1
    cached = compile_regex(regex, backend.vocab)
    assert np.array_equal(fresh.masks_np, cached.masks_np) and np.array_equal(
        fresh.dfa.trans, cached.dfa.trans
    )
    files[0].write_bytes(b"garbage")
    rebuilt = compile_regex(regex, backend.vocab)
    assert np.array_equal(fresh.masks_np, rebuilt.masks_np)


@pytest.mark.parametrize(
    "regex,fragment",
    [
        ("(", "invalid or unsupported regex"),
        (r"\bword", "invalid or unsupported regex"),
        (r"a{3,1}", "invalid or unsupported regex"),
        (r"a**", "invalid or unsupported regex"),
        (r"(?=a)b", "matches no string"),
        ("", "non-empty string"),
    ],
)
def test_bad_regex_raises(backend: GrammarBackend, regex: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        backend.compile("regex", regex, engine="fsm")


def test_too_large_and_timeout(backend: GrammarBackend) -> None:
    small = GrammarBackend(backend.tokenizer, 49152, max_states=50, use_disk_cache=False)
    with pytest.raises(ValueError, match="grammar too large"):
        small.compile("regex", r"[a-z]{100}")
    slow = GrammarBackend(backend.tokenizer, 49152, compile_timeout_s=0.0, use_disk_cache=False)
    with pytest.raises(ValueError, match="timeout"):
        slow.compile("regex", r"[a-zé]{1,40}")
    with pytest.raises(ValueError, match="unknown grammar kind"):
        backend.compile("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fsm engine compiles regex and json_schema only"):
        backend.compile("ebnf", 'root ::= "a"', engine="fsm")


def test_backend_caches_and_compiles_off_thread(backend: GrammarBackend) -> None:
    regex = r"(one|two|three) [0-9]"
    threads = []
    results: list[object] = []
    for _ in range(4):
        t = threading.Thread(target=lambda: results.append(backend.compile("regex", regex)))
        threads.append(t)
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1  # one compile, shared
    fut = backend.compile_async("regex", r"[xyz]{3}")
    assert fut.result(timeout=60).engine == "fsm"
    bad = backend.compile_async("regex", "(")
    with pytest.raises(ValueError):
        bad.result(timeout=60)
    assert backend.compile("ebnf", 'root ::= "a" [0-9]').engine == "xgrammar"
    small = GrammarBackend(backend.tokenizer, 49152, max_cached=2)
    first = small.compile("regex", "a")
    small.compile("regex", "b")
    assert small.compile("regex", "a") is first  # a hit refreshes "a"
    small.compile("regex", "c")  # evicts "b", the least recently used
    assert ("regex", "b", "auto") not in small._cache and len(small._cache) == 2
    assert small.compile("regex", "a") is first
    assert backend.compile("json", "").engine == "xgrammar"


def _sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for piece in ["▁", "▁a", "a", "b", "ab", "▁ab", "é", "▁é", "日本", "▁日", "本", "1", "12", "-", "▁-"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback_vocab_matches_xgrammar() -> None:
    tok = _sentencepiece_tokenizer()
    width = len(tok) + 13  # model logits wider than the tokenizer
    vocab = vocab_from_tokenizer(tok, width)
    assert vocab.vocab_type == "byte_fallback"
    ids = tok.get_vocab()
    assert vocab.token_bytes[ids["<0x0A>"]] == b"\n" and vocab.token_bytes[ids["▁ab"]] == b" ab"
    assert vocab.token_bytes[ids["</s>"]] == b"" and vocab.token_bytes[width - 1] == b""
    be = GrammarBackend(tok, width, use_disk_cache=False)
    for regex in [r"( ab|é|日本)+ ?-[0-9]{1,3}", r"[^a-z]{1,3}", r"(a|b| )*"]:
        grammars = [be.compile("regex", regex, engine=e) for e in ("fsm", "xgrammar")]
        diffs = []

        def compare(allowed: list[np.ndarray], diffs: list = diffs) -> None:
            if not np.array_equal(allowed[0], allowed[1]):
                diffs.append([tok.convert_ids_to_tokens(a.tolist()) for a in allowed])

        for seed in range(4):
            out, finished = random_walk(
                [g.new_matcher() for g in grammars],
                width,
                be.vocab.token_bytes,
                be.vocab.eos_ids,
                seed,
                max_steps=60,
                on_step=compare,
            )
            text = b"".join(be.vocab.token_bytes[i] for i in out).decode("utf-8")
            assert not finished or re.fullmatch(regex, text)
        assert not diffs, diffs[:2]


def test_cache_dir_env(monkeypatch, tmp_path) -> None:
    from radixlm.grammars.fsm import cache_dir

    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    assert str(cache_dir()).startswith(str(tmp_path))
    monkeypatch.delenv("RADIXLM_CACHE")
    assert str(cache_dir()).startswith(os.path.expanduser("~"))
