"""The verification math on a tiny bigram model (vocabulary 6): with deterministic drafts, the
first two tokens sampled at T > 0 through speculation follow the target joint distribution
(temperature, top-k and a frequency penalty applied; chi-squared against the exact product of
the processed conditionals, for the shared generator and a seeded request's own RNG); greedy
verification emits exactly the argmax chain; and the n-gram proposer's lookups."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.backend.request import Req
from radixlm.backend.sampler import Sampler, record_token
from radixlm.backend.sampling_params import SamplingParams
from radixlm.backend.speculative_proposer import NgramIndex, NgramProposer
from radixlm.backend.speculative_verify import verify

V = 6
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 1.5  # logits of next | prev


def make_req(params: dict, seed: int | None = None) -> Req:
    req = Req(
        rid="r", input_ids=[0], params=SamplingParams.from_dict(params), sink=lambda _: None, detok=None
    )  # type: ignore[arg-type]
    if seed is not None:
        req.rng = random.Random(seed)
    return req


def drafts_for(prev: int, k: int) -> list[int]:
    return [(prev + 1 + j) % V for j in range(k)]  # deterministic, sometimes right, often wrong


def spec_two_tokens(sampler: Sampler, reqs: list[Req], ks: list[int]) -> list[tuple[int, int]]:
    """Decode two tokens for every request through verify steps (all requests in each step)."""
    while True:
        live = [(r, k) for r, k in zip(reqs, ks) if len(r.output_ids) < 2]
        if not live:
            return [(r.output_ids[0], r.output_ids[1]) for r in reqs]
        drafts = [drafts_for(r.all_ids[-1], k) for r, k in live]
        logits = torch.cat([TABLE[[r.all_ids[-1], *d]] for (r, _), d in zip(live, drafts)])
        verdicts = verify(sampler, logits, [r for r, _ in live], drafts, [None] * len(live))
        for (req, _), verdict in zip(live, verdicts):
            for tok in verdict.tokens[: 2 - len(req.output_ids)]:
                req.output_ids.append(tok)
                record_token(req, tok)


def target(prev: int, counts: torch.Tensor, p: dict) -> torch.Tensor:
    """The processed next-token distribution, computed by hand (no radixlm code)."""
    logits = TABLE[prev] - p["frequency_penalty"] * counts
    probs = torch.softmax(logits / p["temperature"], dim=-1)
    keep = probs.topk(p["top_k"]).indices
    out = torch.zeros(V)
    out[keep] = probs[keep]
    return out / out.sum()


def exact_joint(p: dict) -> torch.Tensor:
    joint = torch.zeros(V, V)
    p1 = target(0, torch.zeros(V), p)
    for a in range(V):
        counts = torch.zeros(V)
        counts[a] = 1
        joint[a] = p1[a] * target(a, counts, p)
    return joint


@pytest.mark.parametrize("seeded", [False, True])
def test_t1_samples_follow_target(seeded):
    scipy_stats = pytest.importorskip("scipy.stats")
    p = {"temperature": 0.9, "top_k": 4, "frequency_penalty": 0.7}
    sampler = Sampler(V, torch.device("cpu"), seed=11)
    n = 6000
    hist = torch.zeros(V, V)
    rng = random.Random(5)
    reqs = [make_req(p, seed=rng.randrange(1 << 30) if seeded else None) for _ in range(n)]
    for req in reqs:
        sampler.prepare(req)
    for a, b in spec_two_tokens(sampler, reqs, [1 + i % 3 for i in range(n)]):
        hist[a, b] += 1
    exp = exact_joint(p) * n
    mask = exp > 0
    assert hist[~mask].sum() == 0  # nothing outside top-k is ever emitted
    obs, want = hist[mask].numpy(), exp[mask].numpy()
    stat, pval = scipy_stats.chisquare(obs, want * obs.sum() / want.sum())
    assert pval > 1e-3, (stat, pval)


def test_chi2_has_power():
    """The same check rejects a distribution only slightly off (temperature 1.0 for 0.9)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    p = {"temperature": 0.9, "top_k": 4, "frequency_penalty": 0.7}
    n = 6000
    wrong = exact_joint({**p, "temperature": 1.0}).flatten()
    draws = torch.multinomial(wrong, n, replacement=True, generator=torch.Generator().manual_seed(0))
    hist = torch.bincount(draws, minlength=V * V).float().view(V, V)
    exp = exact_joint(p) * n
    mask = exp > 0
    assert scipy_stats.chisquare(hist[mask].numpy(), exp[mask].numpy())[1] < 1e-3


def test_greedy_verification_is_the_argmax_chain():
    sampler = Sampler(V, torch.device("cpu"))
    req = make_req({"temperature": 0, "frequency_penalty": 0.5})
    sampler.prepare(req)
    chain, prev, counts = [], 0, torch.zeros(V)
    for _ in range(4):
        prev = int((TABLE[prev] - 0.5 * counts).argmax())
        counts[prev] += 1
        chain.append(prev)
    d = [*chain[:2], (chain[2] + 1) % V]  # two right, then a wrong draft
    verdict = verify(sampler, TABLE[[0, *d]].clone(), [req], [d], [None])[0]
    assert verdict.accepted == 2 and verdict.tokens == chain[:3]
    verdict = verify(sampler, TABLE[[0, *chain[:3]]].clone(), [req], [chain[:3]], [None])[0]
    assert verdict.accepted == 3 and verdict.tokens == chain


def test_ngram_index_finds_latest_earlier_copy():
    idx = NgramIndex(2, 4)
    idx.sync([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert idx.lookup(2) == [7, 5]  # the latest earlier copy of [1, 2, 3]
    idx.sync([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3, 7])
    assert idx.lookup(3) == [5, 1, 2]
    idx.sync([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 4])  # an earlier token changed: rebuilt
    assert idx.lookup(3) == []


def test_proposer_uses_finished_requests():
    prop = NgramProposer(min_n=2, max_n=3)
    done = make_req({})
    done.input_ids, done.output_ids, done.rid = [5, 6, 7, 8], [9, 10, 11], "done"
    prop.observe_finished(done)
    new = make_req({})
    new.input_ids = [1, 9, 10]
    assert prop.propose(new, 4) == [11]
    assert prop.propose(new, 0) == []
