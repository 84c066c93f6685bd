"""The forked attention-backend workload shared by the backend checks (tests/test_kernels_interp.py,
tests/kv_fp8_checks.py): request 0 extends 6 tokens, requests 1 and 2 fork from its first 6
slots, then a mixed extend, a decode step, a decode step through a cascade plan and a mixed step
whose first two items are decode rows. Each step comes with its ForwardBatch; `causal_ref` is the float64 attention over a request's history."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from radixlm.backend.cascade_groups import make_cascade_plan
from radixlm.backend.forward_batch import AttentionBackend, ForwardBatch
from radixlm.backend.kv_pool import KVPool, ReqToTokenTable, TokenSlotAllocator

# (requests, tokens each extends by, mode)
STEPS: list[tuple[list[int], list[int], str | None]] = [
    ([0], [6], None),
    ([0, 1, 2], [1, 3, 2], None),
    ([0, 1, 2], [1, 1, 1], None),
    ([0, 1, 2], [1, 1, 1], "cascade"),
    ([0, 1, 2], [1, 1, 2], None),
]
FORK_LEN = 6


@dataclass
class Step:
    index: int
    reqs: list[int]
    ext: list[int]
    mode: str | None
    prefix: list[int]  # tokens each request held before this step
    starts: list[int]  # each request's first row among the step's tokens
    slots: torch.Tensor
    fb: ForwardBatch

    @property
    def tokens(self) -> int:
        return sum(self.ext)

    def label(self) -> str:
        return f"step {self.index} ({self.mode or ('decode' if self.fb.is_decode else 'extend')})"


def forked_steps(pool: KVPool, backend: AttentionBackend, device: str) -> Iterator[Step]:
    """The steps in order; a caller that keeps per-request histories copies request 0's first
    FORK_LEN entries to requests 1 and 2 at step 1."""
    alloc, table = TokenSlotAllocator(pool.size), ReqToTokenTable(4, 32, device)
    rows = [table.alloc() for _ in range(3)]
    lens = [0, 0, 0]
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    for i, (reqs, ext, mode) in enumerate(STEPS):
        if i == 1:
            for r in (1, 2):
                table.table[rows[r], :FORK_LEN] = table.table[rows[0], :FORK_LEN]
                lens[r] = FORK_LEN
        prefix = [lens[r] for r in reqs]
        slots = alloc.alloc(sum(ext)).to(device)
        starts = [sum(ext[:j]) for j in range(len(ext))]
        for r, p, e, s0 in zip(reqs, prefix, ext, starts):
            table.write(rows[r], p, slots[s0 : s0 + e])
            lens[r] = p + e
        seq = [p + e for p, e in zip(prefix, ext)]
        fb = ForwardBatch(
            input_ids=as_t([0] * sum(ext)),
            positions=as_t([j for p, e in zip(prefix, ext) for j in range(p, p + e)]),
            out_cache_loc=slots,
            req_pool_indices=as_t([rows[r] for r in reqs]),
            seq_lens=as_t(seq),
            prefix_lens=as_t(prefix),
            extend_lens=as_t(ext),
            extend_start_loc=as_t(starts),
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=ext,
            req_pool_indices_cpu=[rows[r] for r in reqs],
            extend_start_loc_cpu=starts,
            logits_indices=as_t(starts),
            req_to_token=table.table,
            kv_pool=pool,
            attn_backend=backend,
            is_decode=all(e == 1 for e in ext),
        )
        if mode == "cascade":
            fb.cascade_plan = make_cascade_plan([3], [FORK_LEN], seq, device)
        yield Step(i, reqs, ext, mode, prefix, starts, slots, fb)


def causal_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """float64 attention of q [e, Hq, D] (positions prefix..prefix+e-1) over k/v [prefix+e, Hkv,
    D] (float64, CPU), causal, KV heads shared by Hq / Hkv query heads."""
    e, hq, d = q.shape
    group = hq // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double().cpu(), kk) / d**0.5
    s = s.masked_fill(torch.arange(prefix + e)[None, :] > (prefix + torch.arange(e))[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
