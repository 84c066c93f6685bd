"""Bitmask application: the torch path against a per-element loop, the Triton kernel against the
torch path under TRITON_INTERPRET=1 (in a subprocess so the env var is set before triton loads),
and our FSM's bitmask rows against xgrammar's own apply function."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from radixlm.grammars import allocate_token_bitmask, apply_token_bitmask_
from radixlm.kernels.bitmask import apply_token_bitmask_torch_


def _random_case(batch: int, vocab: int, words: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g)
    words = words if words is not None else (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=g)
    return logits, bitmask


def _naive(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            w = t // 32
            allowed = w < bitmask.shape[1] and (int(bitmask[b, w]) >> (t % 32)) & 1
            if not allowed:
                out[b, t] = float("-inf")
    return out


@pytest.mark.parametrize(
    "batch,vocab,words", [(1, 31, None), (3, 100, None), (2, 64, None), (2, 70, 2), (2, 40, 4)]
)
def test_torch_path_matches_naive(batch: int, vocab: int, words: int | None) -> None:
    logits, bitmask = _random_case(batch, vocab, words)
    expected = _naive(logits, bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("batch,vocab,words", [(3, 100, None), (2, 70, 2), (2, 40, 4)])
def test_torch_reference_matches_naive(batch: int, vocab: int, words: int | None) -> None:
    logits, bitmask = _random_case(batch, vocab, words, seed=7)
    expected = _naive(logits, bitmask)
    apply_token_bitmask_torch_(logits, bitmask)
    assert torch.equal(logits, expected)


class _FixedMatcher:
    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.row)


def test_apply_grammar_masks_rows_and_fallback() -> None:
    from types import SimpleNamespace

    from radixlm.grammars.masking import apply_grammar_masks

    vocab = 70
    logits, bitmask = _random_case(3, vocab, seed=5)
    logits[2, :] = float("-inf")  # another mask (e.g. min_new_tokens) already removed everything here
    reqs = [
        SimpleNamespace(grammar=_FixedMatcher(bitmask[0])),
        SimpleNamespace(grammar=None),
        SimpleNamespace(grammar=_FixedMatcher(bitmask[2])),
    ]
    out = logits.clone()
    apply_grammar_masks(out, reqs)
    assert torch.equal(out[0], _naive(logits[:1], bitmask[:1])[0])
    assert torch.equal(out[1], logits[1])  # unconstrained row untouched
    assert torch.equal(out[2], _naive(torch.zeros(1, vocab), bitmask[2:3])[0])  # the grammar wins


def test_apply_grammar_masks_alone_equals_the_guarded_path() -> None:
    """Without earlier masks the grammar's mask is applied alone (in place, by row index): the
    same logits as the guarded path, which also handles rows another mask emptied."""
    from types import SimpleNamespace

    from radixlm.grammars.masking import apply_grammar_masks

    logits, bitmask = _random_case(5, 100, seed=9)
    reqs = [SimpleNamespace(grammar=_FixedMatcher(bitmask[i]) if i in (0, 2, 3) else None) for i in range(5)]
    alone, guarded = logits.clone(), logits.clone()
    apply_grammar_masks(alone, reqs, others_masked=False)
    apply_grammar_masks(guarded, reqs, others_masked=True)
    assert torch.equal(alone, guarded)
    assert torch.equal(alone[[1, 4]], logits[[1, 4]])
    assert torch.equal(alone[[0, 2, 3]], _naive(logits[[0, 2, 3]], bitmask[[0, 2, 3]]))


def test_indices_apply_rows_subset() -> None:
    logits, bitmask = _random_case(2, 96)
    full = torch.randn(5, 96)
    ref = full.clone()
    idx = torch.tensor([3, 1])
    apply_token_bitmask_torch_(full, bitmask, idx)
    ref[idx] = _naive(ref[idx], bitmask)
    assert torch.equal(full, ref)


def test_allocate_is_all_allowed() -> None:
    bm = allocate_token_bitmask(2, 33)
    assert bm.shape == (2, 2) and bm.dtype == torch.int32
    logits = torch.randn(2, 33)
    ref = logits.clone()
    apply_token_bitmask_(logits, bm)
    assert torch.equal(logits, ref)


def test_matches_xgrammar_apply() -> None:
    xgr = pytest.importorskip("xgrammar")
    logits, bitmask = _random_case(3, 1000, seed=3)
    ours = logits.clone()
    apply_token_bitmask_(ours, bitmask)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(ours, logits)


TRITON_SCRIPT = textwrap.dedent("""
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from radixlm.kernels.bitmask import apply_token_bitmask_torch_, apply_token_bitmask_triton_
    g = torch.Generator().manual_seed(0)
    for batch, vocab, words, dtype, block in [(2, 100, 4, torch.float32, 32), (3, 257, 9, torch.float16, 64),
                                             (1, 70, 2, torch.float32, 32), (2, 64, 3, torch.bfloat16, 128)]:
        logits = torch.randn(batch, vocab, generator=g).to(dtype)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=g)
        a, b = logits.clone(), logits.clone()
        apply_token_bitmask_torch_(a, bitmask)
        apply_token_bitmask_triton_(b, bitmask, block=block)
        assert torch.equal(a, b), (batch, vocab, dtype)
        big = torch.randn(4, vocab, generator=g).to(dtype)
        c, d = big.clone(), big.clone()
        idx = torch.tensor([2, 0][:batch] if batch <= 2 else [3, 0, 1])
        apply_token_bitmask_torch_(c, bitmask[: len(idx)], idx)
        apply_token_bitmask_triton_(d, bitmask[: len(idx)].contiguous(), idx, block=block)
        assert torch.equal(c, d), ("indices", batch, vocab, dtype)
    print("OK")
""")


def test_triton_kernel_matches_torch_interpreted() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_batched_fill_equals_row_by_row() -> None:
    """fill_bitmask computes llguidance rows in one pooled call: every row, at a different point of
    its document (and one ended, one regex row on our FSM among them), equals the matcher's own fill."""
    import json

    from test_grammar_cases import default_tokenizer

    from radixlm.grammars import GrammarBackend
    from radixlm.grammars.masking import fill_bitmask
    from radixlm.grammars.xgrammar_backend import XGrammarRows

    backend = GrammarBackend(default_tokenizer(), 49152)
    tok = backend.tokenizer
    # open: outside xgrammar's exact subset, so llguidance fills these masks (a closed twin below
    # gets xgrammar's, batched in the same call)
    closed = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    schema = json.dumps({k: v for k, v in closed.items() if k != "additionalProperties"})
    doc = '{"a": 12, "b": "yz"}'
    grammars = []
    for cut in (0, 1, 5, 9, 14, len(doc)):
        m = backend.compile("json_schema", schema).new_matcher()
        for t in tok.encode(doc[:cut], add_special_tokens=False):
            assert m.accept_token(t)
        grammars.append(m)
    grammars[-1].accept_token(tok.eos_token_id)  # ended: the stop-token row
    regex = backend.compile("regex", "[0-9]+").new_matcher()
    grammars.insert(2, regex)
    exact = backend.compile("json_schema", closed).new_matcher()
    assert isinstance(exact.parallel_mask_matcher(), XGrammarRows)
    assert exact.accept_string('{"a": 1')
    grammars.insert(4, exact)
    assert sum(getattr(g, "parallel_mask_matcher", lambda: None)() is not None for g in grammars) >= 4

    reqs = [type("Req", (), {"grammar": g})() for g in grammars]
    reqs.insert(1, type("Req", (), {"grammar": None})())  # an unconstrained row is skipped
    batched, rows = fill_bitmask(reqs, 49152)
    assert rows == [0, *range(2, len(reqs))]
    one_by_one = allocate_token_bitmask(len(grammars), 49152)
    for k, g in enumerate(grammars):
        g.fill_next_token_bitmask(one_by_one, k)
    assert torch.equal(batched, one_by_one)
    assert not torch.equal(batched[0], batched[1])
