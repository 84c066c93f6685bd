"""Grammar masks for one sampling step: fill the bitmask rows of the constrained requests and apply
them to their logits rows. Promises: unconstrained rows are untouched; a row never ends up all -inf
(if other masks, e.g. min_new_tokens, removed every grammar-allowed token, the grammar wins)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixlm.kernels.bitmask import unpack_bitmask_cpu

from .base import allocate_token_bitmask, apply_token_bitmask_


def fill_bitmask(reqs: Sequence[Any], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """Bitmask rows for the requests whose .grammar is set (duck-typed matcher), and their indices."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    bitmask = allocate_token_bitmask(len(rows), vocab_size)
    for k, i in enumerate(rows):
        reqs[i].grammar.fill_next_token_bitmask(bitmask, k)
    return bitmask, rows


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Any]) -> None:
    """In place on [N, V] logits, one row per request in order; no host sync on CUDA."""
    bitmask, rows = fill_bitmask(reqs, logits.shape[-1])
    if not rows:
        return
    idx = torch.tensor(rows, device=logits.device)
    sub = logits[idx]
    if logits.is_cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        apply_token_bitmask_(sub, bitmask)
        grammar_only = torch.zeros_like(sub)  # used where other masks left nothing the grammar allows
        apply_token_bitmask_(grammar_only, bitmask)
        dead = torch.isneginf(sub).all(dim=-1, keepdim=True)
        logits[idx] = torch.where(dead, grammar_only, sub)
        return
    forbidden = ~unpack_bitmask_cpu(bitmask, logits.shape[-1])
    sub.masked_fill_(forbidden, float("-inf"))
    dead = torch.isneginf(sub).all(dim=-1)
    if bool(dead.any()):
        sub[dead] = torch.zeros_like(sub[dead]).masked_fill_(forbidden[dead], float("-inf"))
    logits[idx] = sub
