"""Verification of draft tokens against the target model's logits: each draft position's logits
get the same processing one decode step would give them (penalties counting the drafts before
it, the min_new_tokens EOS mask, the grammar mask after the drafts before it, temperature,
top-k/top-p/min-p), then the longest acceptable prefix is kept. Promises: greedy rows emit exactly
the tokens plain decoding would; sampled rows follow the target distribution — a deterministic
draft x is accepted with probability p(x), and on rejection the token comes from p with x
removed and renormalized, so P(x) = p(x) and P(y) = (1 - p(x)) p(y) / (1 - p(x)) = p(y)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from .forward_batch import to_device
from .request import Req, RequestGrammar
from .sampler import Sampler
from .sampling_params import SamplingParams


class FixedMask:
    """A grammar stand-in for one verify row: the bitmask the real matcher gave at that draft
    position (computed at proposal time, while the matcher walked the drafts)."""

    def __init__(self, bits: torch.Tensor) -> None:
        self.bits = bits  # [1, words] int32

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.bits[0]


@dataclass(eq=False)
class VerifyRow:
    """What the sampler reads of a request, as it stands j drafts later."""

    params: SamplingParams
    output_ids: range  # only its length is read (min_new_tokens)
    penalty_counts: torch.Tensor | None
    penalty_seen: torch.Tensor | None
    grammar: FixedMask | RequestGrammar | None
    stops: set[int]

    def stop_tokens(self) -> set[int]:
        return self.stops


def verify_rows(req: Req, drafts: list[int], masks: list[torch.Tensor] | None) -> list[VerifyRow]:
    """len(drafts) + 1 rows: row j is the state after drafts[:j] were appended. A constrained
    request with drafts brings the masks of its rows; without drafts its matcher masks its row."""
    assert not (drafts and req.grammar is not None and masks is None), (
        "drafts of a constrained request need masks"
    )
    n0, stops = len(req.output_ids), req.stop_tokens()
    counts = seen = None
    if req.penalty_counts is not None and req.penalty_seen is not None and drafts:
        k = len(drafts)
        dev = req.penalty_counts.device
        step = torch.zeros(k + 1, req.penalty_counts.numel(), device=dev)
        ids = to_device(drafts, dev)
        step[torch.arange(1, k + 1, device=dev), ids] = 1.0
        counts = req.penalty_counts.unsqueeze(0) + step.cumsum(0)
        seen = req.penalty_seen.unsqueeze(0) | (counts > 0)
    rows = []
    for j in range(len(drafts) + 1):
        c = counts[j] if counts is not None else req.penalty_counts
        s = seen[j] if seen is not None else req.penalty_seen
        g: FixedMask | RequestGrammar | None = FixedMask(masks[j]) if masks is not None else req.grammar
        rows.append(VerifyRow(req.params, range(n0 + j), c, s, g, stops))
    return rows


@dataclass
class Verdict:
    """One request's result: the tokens it emits (accepted drafts, then one token of its own)."""

    tokens: list[int]
    accepted: int  # how many of tokens are drafts


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: Sequence[Req],
    drafts: Sequence[list[int]],
    masks: Sequence[list[torch.Tensor] | None],
) -> list[Verdict]:
    """logits: [sum(len(d) + 1), V] rows, request by request, row j of a request scoring the token
    after drafts[:j]. Modified in place. One host sync."""
    rows: list[VerifyRow] = []
    for req, d, m in zip(reqs, drafts, masks):
        rows.extend(verify_rows(req, d, m))
    sampler.process_(logits, cast(Sequence[Req], rows))  # VerifyRow reads as a Req to the sampler
    greedy = to_device([r.params.is_greedy for r in rows], logits.device, torch.bool)
    argmax = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    p_draft = sample = uniform = None
    if random_rows:
        p_draft, sample, uniform = _random_parts(sampler, logits, rows, reqs, drafts, random_rows)
    chosen = torch.where(greedy, argmax, sample if sample is not None else argmax)
    host_tokens = chosen.tolist()
    host_p = p_draft.tolist() if p_draft is not None else None
    out, r = [], 0
    for req, d in zip(reqs, drafts):
        out.append(_accept(d, host_tokens[r : r + len(d) + 1], host_p, uniform, r, req.params.is_greedy))
        r += len(d) + 1
    return out


def _accept(
    d: list[int], tokens: list[int], p: list[float] | None, u: list[float] | None, r0: int, greedy: bool
) -> Verdict:
    for j, x in enumerate(d):
        if greedy:
            ok = tokens[j] == x
        else:
            assert p is not None and u is not None
            ok = u[r0 + j] < p[r0 + j]
        if not ok:
            return Verdict([*d[:j], tokens[j]], j)
    return Verdict([*d, tokens[len(d)]], len(d))


def _random_parts(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[VerifyRow],
    reqs: Sequence[Req],
    drafts: Sequence[list[int]],
    idx: list[int],
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """For every row: p(draft) under the target distribution (0 where the row has no draft), a
    token from the residual (p without the draft, renormalized; the whole p on a request's last
    row), and the acceptance uniform (host list, one per row)."""
    dev = logits.device
    draft_of: list[int] = []  # the draft each row is tested against (-1: the request's last row)
    rng_of: list[Req] = []
    for req, d in zip(reqs, drafts):
        draft_of.extend([*d, -1])
        rng_of.extend([req] * (len(d) + 1))
    sub_rows = [rows[i] for i in idx]
    probs = sampler.target_probs(logits[to_device(idx, dev)], cast(Sequence[Req], sub_rows))
    x = to_device([draft_of[i] for i in idx], dev)
    has = x >= 0
    px = probs.gather(1, x.clamp(min=0).unsqueeze(1)).squeeze(1) * has
    residual = probs.scatter(1, x.clamp(min=0).unsqueeze(1), 0.0)
    residual = torch.where(has.unsqueeze(1), residual, probs)
    u_accept, u_sample = _uniforms(sampler, [rng_of[i] for i in idx], dev)
    cdf = residual.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u_sample * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    pick = pick.clamp(max=probs.shape[1] - 1)
    n = logits.shape[0]
    p_all = torch.zeros(n, device=dev)
    s_all = torch.zeros(n, dtype=torch.int64, device=dev)
    where = to_device(idx, dev)
    p_all[where], s_all[where] = px, pick
    u_all = [0.0] * n
    for i, u in zip(idx, u_accept):
        u_all[i] = u
    return p_all, s_all, u_all


def _uniforms(sampler: Sampler, reqs: list[Req], dev: torch.device) -> tuple[list[float], torch.Tensor]:
    """Two uniforms per row: a seeded request draws from its own RNG (independent of the batch),
    the rest from the sampler's generator."""
    shared = torch.rand(2, len(reqs), generator=sampler.generator, device=sampler.generator.device)
    shared_host = shared.cpu().tolist()
    acc, smp = [], []
    for k, req in enumerate(reqs):
        if req.rng is not None:
            acc.append(req.rng.random())
            smp.append(req.rng.random())
        else:
            acc.append(shared_host[0][k])
            smp.append(shared_host[1][k])
    return acc, to_device(smp, dev, torch.float32)
