"""Grammar masks for one sampling step: fill the bitmask rows of the constrained requests and apply
them to their logits rows. Promises: unconstrained rows are untouched; a row never ends up all -inf
(if other masks, e.g. min_new_tokens, removed every grammar-allowed token, the grammar wins)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import llguidance as llg
import numpy as np
import torch
import xgrammar as xgr

from radixlm.kernels.bitmask import unpack_bitmask_cpu

from .base import allocate_token_bitmask, apply_token_bitmask_
from .xgrammar_backend import XGrammarRows, XGrammarVocab, fill_xgrammar_rows


def fill_bitmask(
    reqs: Sequence[Any], vocab_size: int, pin_memory: bool = False
) -> tuple[torch.Tensor, list[int]]:
    """Bitmask rows for the requests whose .grammar is set (duck-typed matcher), and their indices.
    Rows backed by llguidance are computed in one call on its thread pool, outside the GIL, so a
    large batch's masks are filled in parallel and other Python threads run meanwhile; rows backed
    by xgrammar in one call too (microseconds each: one call saves the per-row Python)."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    bitmask = allocate_token_bitmask(len(rows), vocab_size, pin_memory)
    batched: list[tuple[llg.LLMatcher, int]] = []
    xgr_groups: dict[XGrammarVocab, tuple[list[xgr.GrammarMatcher], list[int]]] = {}  # by id layout
    for k, i in enumerate(rows):
        grammar = reqs[i].grammar
        source = getattr(grammar, "parallel_mask_matcher", None)
        matcher = source() if source is not None else None
        if matcher is None:
            grammar.fill_next_token_bitmask(bitmask, k)
        elif isinstance(matcher, XGrammarRows):
            matchers, ks = xgr_groups.setdefault(matcher.layout, ([], []))
            matchers.append(matcher.matcher)
            ks.append(k)
        else:
            batched.append((matcher, k))
    for layout, (matchers, ks) in xgr_groups.items():
        fill_xgrammar_rows(bitmask, matchers, ks, layout)
    if len(batched) == 1:
        matcher, k = batched[0]
        matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), bitmask.shape[1] * 4)
    elif batched:
        _executor().unsafe_compute_mask_ptr(
            batched, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )
    _open_dead_ends(bitmask, [reqs[i] for i in rows])
    return bitmask, rows


def _open_dead_ends(bitmask: torch.Tensor, reqs: Sequence[Any]) -> None:
    """A row that allows nothing (no token continues a valid document) allows the stop tokens, so
    the sampled token is a stop token the matcher refuses and the request ends as a dead end."""
    words = bitmask.numpy().view(np.uint32)  # numpy: one thread, no hand-off to torch's pool
    empty = np.flatnonzero(~words.any(axis=1)).tolist()
    if not empty:
        return
    for k in empty:
        stop_tokens = getattr(reqs[k], "stop_tokens", None)
        for t in stop_tokens() if stop_tokens is not None else ():
            if 0 <= t < words.shape[1] * 32:
                words[k, t // 32] |= np.uint32(1 << (t % 32))


MAX_MASK_THREADS = 4


@functools.cache
def _executor() -> llg.LLExecutor:
    """llguidance's pool for a step's masks. Its default (80% of the CPUs) measured slower than 4
    threads for 64 rows of one schema on a 16-core host (the matchers of one grammar share its
    lexer cache), and every thread it adds takes a core from the scheduler and the tokenizer."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return llg.LLExecutor(num_threads=mask_threads(usable))


def mask_threads(usable_cpus: int) -> int:
    """Threads for the mask pool: a quarter of the usable CPUs, 1 to MAX_MASK_THREADS."""
    return max(1, min(MAX_MASK_THREADS, usable_cpus // 4))


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Any], others_masked: bool = True) -> None:
    """In place on [N, V] logits, one row per request in order; no host sync on CUDA.
    others_masked: whether earlier masks (min_new_tokens) may have set -inf, so that a row could be
    left with nothing the grammar allows; without them the grammar's mask is applied alone."""
    # pinned on CUDA, so the mask's copy to the device is an asynchronous DMA transfer
    bitmask, rows = fill_bitmask(reqs, logits.shape[-1], pin_memory=logits.is_cuda)
    if not rows:
        return
    whole = len(rows) == logits.shape[0]  # every row constrained: no gather, no scatter back
    idx = (
        None if whole else torch.tensor(rows, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
    )
    if not others_masked:
        apply_token_bitmask_(logits, bitmask, idx)
        return
    sub = logits if idx is None else logits[idx]
    if logits.is_cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        grammar_only = torch.zeros_like(sub)  # used where other masks left nothing the grammar allows
        apply_token_bitmask_(grammar_only, bitmask)
        apply_token_bitmask_(sub, bitmask)
        dead = torch.isneginf(sub).all(dim=-1, keepdim=True)
        masked = torch.where(dead, grammar_only, sub)
        if idx is None:
            logits.copy_(masked)
        else:
            logits[idx] = masked
        return
    forbidden = ~unpack_bitmask_cpu(bitmask, logits.shape[-1])
    sub.masked_fill_(forbidden, float("-inf"))
    dead = torch.isneginf(sub).all(dim=-1)
    if bool(dead.any()):
        sub[dead] = torch.zeros_like(sub[dead]).masked_fill_(forbidden[dead], float("-inf"))
    if idx is not None:
        logits[idx] = sub
