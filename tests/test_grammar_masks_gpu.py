"""Grammar masks on the device: the grammar's mask applied alone (by row index, in place) gives the
same logits as the guarded path and as the CPU reference, for a batch where only some rows are
constrained."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixlm.grammars.masking import apply_grammar_masks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _FixedMatcher:
    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.row)


@pytest.mark.parametrize("constrained", [(0, 2, 3), (0, 1, 2, 3, 4)])
def test_mask_alone_matches_guarded_and_cpu(constrained: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(3)
    vocab = 49152 + 17
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    reqs = [
        SimpleNamespace(grammar=_FixedMatcher(bitmask[i]) if i in constrained else None) for i in range(5)
    ]
    cpu = logits.clone()
    apply_grammar_masks(cpu, reqs, others_masked=True)
    alone, guarded = logits.cuda(), logits.cuda()
    apply_grammar_masks(alone, reqs, others_masked=False)
    apply_grammar_masks(guarded, reqs, others_masked=True)
    assert torch.equal(alone.cpu(), guarded.cpu())
    assert torch.equal(alone.cpu(), cpu)
