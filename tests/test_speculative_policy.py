"""The speculation policy on synthetic step costs: it measures plain decode first, explores with a
few drafts only, keeps drafts when acceptance and measured costs say they pay (batch 1, high
acceptance), declines when acceptance is low or drafts are dear beside a large batch, and a request
whose drafts keep failing sits out a while."""

from __future__ import annotations

from radixlm.backend.request import Req
from radixlm.backend.sampling_params import SamplingParams
from radixlm.backend.speculative_policy import EXPLORE_DRAFTS, MIN_SAMPLES, SpecPolicy


def reqs(n: int) -> list[Req]:
    return [
        Req(rid=str(i), input_ids=[1], params=SamplingParams(), sink=lambda _: None, detok=None)  # type: ignore[arg-type]
        for i in range(n)
    ]


def trained(decode_s: float, per_draft_s: float, batch: int, drafts: int) -> SpecPolicy:
    pol = SpecPolicy(adaptive=True)
    for _ in range(MIN_SAMPLES):
        pol.record(False, batch, 0, decode_s)
    for _ in range(MIN_SAMPLES):
        pol.record(True, batch, drafts, decode_s + per_draft_s * drafts)
    assert pol.costs.ready
    return pol


def test_measures_decode_first_then_explores_with_few_drafts():
    pol = SpecPolicy(adaptive=True)
    batch = reqs(8)
    props = [[5, 6, 7, 8] for _ in batch]
    assert not any(pol.choose(batch, props))
    for _ in range(MIN_SAMPLES):
        pol.record(False, 8, 0, 0.1)
    assert sum(len(p) for p in pol.choose(batch, props)) == EXPLORE_DRAFTS


def test_batch_one_high_acceptance_keeps_drafts():
    pol = trained(decode_s=0.05, per_draft_s=0.005, batch=1, drafts=4)
    (r,) = reqs(1)
    for _ in range(5):
        pol.observe(r, 4, 4)
    assert pol.choose([r], [[1, 2, 3, 4]]) == [[1, 2, 3, 4]]


def test_low_acceptance_or_dear_drafts_decline():
    pol = trained(decode_s=0.05, per_draft_s=0.005, batch=1, drafts=4)
    (r,) = reqs(1)
    pol.observe(r, 4, 1)
    assert pol.choose([r], [[1, 2, 3, 4]]) == [[1, 2]]  # only drafts likely enough to pay
    for _ in range(5):
        pol.observe(r, 4, 0)
    assert pol.paused(r)  # repeated misses: it sits out
    big = reqs(64)
    dear = trained(decode_s=0.5, per_draft_s=0.05, batch=64, drafts=64)
    for q in big:
        dear.observe(q, 4, 2)
    assert not any(dear.choose(big, [[1, 2, 3, 4] for _ in big]))


def test_cooldown_grows_and_ends():
    pol = SpecPolicy(adaptive=True)
    (r,) = reqs(1)
    pol.observe(r, 4, 0)
    pol.observe(r, 4, 0)
    paused = 0
    while pol.paused(r):
        paused += 1
    assert paused >= 4
    assert not pol.paused(r)
