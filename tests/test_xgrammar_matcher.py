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
    bits = (mask[0].to(torch.int64)[:, None] >> torch.arange(32)) & 1
    return [t for t in torch.nonzero(bits.flatten()).flatten().tolist() if t < VOCAB]


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
            assert m.parallel_mask_matcher() is (None if m._m.is_terminated() else m._m)
    assert terminations > 0 and rollbacks_of_a_stop > 0  # both sides of the cache were exercised
