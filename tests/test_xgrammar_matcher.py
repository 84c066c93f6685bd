"""`XGrammarMatcher` keeps whether it terminated instead of asking xgrammar at every query: random
walks of accepts (stop tokens included), rollbacks and resets on a small JSON grammar with the
default tokenizer, the kept answer checked against xgrammar's own after every operation."""

from __future__ import annotations

import json
import random

import torch
import xgrammar as xgr
from test_grammar_cases import default_tokenizer

from radixlm.grammars.xgrammar_backend import XGrammarCompiled, XGrammarMatcher, make_tokenizer_info

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
VOCAB = 49152


def _allowed(m: XGrammarMatcher) -> list[int]:
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    m.fill_next_token_bitmask(mask, 0)
    return [t for t in torch.nonzero(_bits(mask[0])).flatten().tolist() if t < VOCAB]


def _bits(mask_row: torch.Tensor) -> torch.Tensor:
    return ((mask_row.to(torch.int64)[:, None] >> torch.arange(32)) & 1).flatten()


def test_kept_termination_matches_xgrammar_through_random_walks() -> None:
    tok = default_tokenizer()
    stops = [tok.eos_token_id]
    info = make_tokenizer_info(tok, VOCAB, stops)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    grammar = XGrammarCompiled(compiled, VOCAB, stops)
    rng = random.Random(0)
    terminations = rollbacks_of_a_stop = 0
    for _ in range(12):
        m = grammar.new_matcher()
        accepted = 0
        for _ in range(40):
            op = rng.random()
            if op < 0.15 and accepted:
                k = rng.randint(1, accepted)
                rollbacks_of_a_stop += m.is_terminated()
                m.rollback(k)
                accepted -= k
            elif op < 0.18:
                m.reset()
                accepted = 0
            else:
                allowed = _allowed(m)
                pick = stops[0] if stops[0] in allowed and rng.random() < 0.5 else rng.choice(allowed)
                if m.accept_token(pick):
                    accepted += 1
                    terminations += m.is_terminated()
                elif m.is_terminated():
                    assert not m.accept_token(pick)
            assert m.is_terminated() == m._m.is_terminated()
            rows = m.parallel_mask_matcher()
            assert (rows is None) if m._m.is_terminated() else (rows is not None and rows.matcher is m._m)
    assert terminations > 0 and rollbacks_of_a_stop > 0  # both sides of the cache were exercised


def test_padded_model_vocabulary_is_not_xgrammar_special_tokens() -> None:
    """A model whose LM head is wider than its tokenizer (padding ids): xgrammar sees only the ids
    the tokenizer defines (it scans its special-token list on every accept, so 79,104 padding ids
    cost ~25 us per token), and masks as wide as the model's vocabulary, filled one row at a time or
    batched, equal the unpadded masks with every padding id disallowed."""
    from radixlm.grammars import GrammarBackend
    from radixlm.grammars.masking import fill_bitmask

    tok = default_tokenizer()
    padded = VOCAB + 1003  # not a multiple of 32: the last word is part tokenizer, part padding
    stops = [tok.eos_token_id]
    assert len(make_tokenizer_info(tok, padded, stops).special_token_ids) == len(
        make_tokenizer_info(tok, VOCAB, stops).special_token_ids
    )
    ref = GrammarBackend(tok, VOCAB, stop_token_ids=stops).compile("json_schema", SCHEMA, "xgrammar")
    wide = GrammarBackend(tok, padded, stop_token_ids=stops).compile("json_schema", SCHEMA, "xgrammar")
    rng = random.Random(1)
    walks = [(ref.new_matcher(), wide.new_matcher()) for _ in range(3)]
    for _ in range(30):
        reqs = [type("Req", (), {"grammar": w})() for _, w in walks]
        batched, _ = fill_bitmask(reqs, padded)
        for k, (r, w) in enumerate(walks):
            one = xgr.allocate_token_bitmask(1, padded)
            w.fill_next_token_bitmask(one, 0)
            assert torch.equal(one[0], batched[k])
            expected = xgr.allocate_token_bitmask(1, VOCAB)
            r.fill_next_token_bitmask(expected, 0)
            bits, ref_bits = _bits(one[0]), _bits(expected[0])
            assert torch.equal(bits[:VOCAB], ref_bits[:VOCAB])
            assert not bits[VOCAB:].any()
            allowed = torch.nonzero(ref_bits[:VOCAB]).flatten().tolist()
            if not allowed or r.is_terminated():
                continue
            pick = rng.choice(allowed)
            assert r.accept_token(pick) and w.accept_token(pick)
    assert not walks[0][1].accept_token(VOCAB + 5)  # a padding id is never accepted


def test_stop_ids_past_the_tokenizer_are_not_brought_in_with_the_padding() -> None:
    """A Llama-3 shape over a smaller tokenizer: the model stops on ids 128001 and 128009, far past
    the tokenizer's 49,152. xgrammar still sees only the tokenizer's ids (no 78,857 padding
    specials), with one blanked special token as the stop's proxy; the masks, batched or one row at a
    time, equal the masks of the same grammar stopping on an in-range id, with the far stop ids in
    its place and the proxy never allowed; a far stop id is accepted, terminates, rolls back."""
    from radixlm.grammars import GrammarBackend
    from radixlm.grammars.masking import fill_bitmask

    tok = default_tokenizer()
    padded, far = 128256, [128001, 128009]
    info = make_tokenizer_info(tok, padded, far)
    assert info.vocab_size == VOCAB
    assert len(info.special_token_ids) == len(
        make_tokenizer_info(tok, VOCAB, [tok.eos_token_id]).special_token_ids
    )
    ref_stop = tok.eos_token_id
    ref = GrammarBackend(tok, VOCAB, stop_token_ids=[ref_stop]).compile("json_schema", SCHEMA, "xgrammar")
    wide = GrammarBackend(tok, padded, stop_token_ids=far).compile("json_schema", SCHEMA, "xgrammar")
    proxy = wide.layout.proxy
    assert proxy is not None and proxy < VOCAB and proxy not in far
    rng = random.Random(2)
    walks = [(ref.new_matcher(), wide.new_matcher()) for _ in range(4)]
    stop_allowed_seen = 0
    for _ in range(40):
        reqs = [type("Req", (), {"grammar": w})() for _, w in walks]
        batched, _ = fill_bitmask(reqs, padded)
        for k, (r, w) in enumerate(walks):
            if r.is_terminated():
                continue
            one = xgr.allocate_token_bitmask(1, padded)
            w.fill_next_token_bitmask(one, 0)
            assert torch.equal(one[0], batched[k])
            expected = xgr.allocate_token_bitmask(1, VOCAB)
            r.fill_next_token_bitmask(expected, 0)
            bits, ref_bits = _bits(one[0]), _bits(expected[0])[:VOCAB]
            stop_allowed = bool(ref_bits[ref_stop])
            assert all(bool(bits[s]) == stop_allowed for s in far)
            assert not bits[proxy] and (proxy == ref_stop or not ref_bits[proxy])
            keep = torch.ones(VOCAB, dtype=torch.bool)
            keep[[ref_stop, proxy]] = False
            assert torch.equal(bits[:VOCAB][keep], ref_bits[keep])
            beyond = bits[VOCAB:].clone()
            beyond[[s - VOCAB for s in far]] = 0
            assert not beyond.any()
            stop_allowed_seen += stop_allowed
            choices = [t for t in torch.nonzero(ref_bits).flatten().tolist() if t != ref_stop]
            if stop_allowed and (rng.random() < 0.5 or not choices):
                s = rng.choice(far)
                assert w.accept_token(s) and w.is_terminated()
                w.rollback(1)
                assert not w.is_terminated() and w.accept_token(s) and w.is_terminated()
                assert r.accept_token(ref_stop) and r.is_terminated()
                continue
            pick = rng.choice(choices)
            assert r.accept_token(pick) and w.accept_token(pick)
    assert stop_allowed_seen > 0 and all(r.is_terminated() for r, _ in walks)
    assert not walks[0][1].accept_token(proxy)  # the proxy is xgrammar's, never the model's
