"""The speculation policy on synthetic step costs: it measures plain decode first, explores with a
few drafts only (alternating full and half counts), keeps drafts when acceptance and measured
costs say they pay (batch 1, high acceptance), declines when acceptance is low or drafts are dear
beside a large batch, and a request whose drafts keep failing sits out a while. Verify costs are a
fixed part plus a per-draft part, per batch bucket. Backed off, it re-measures at doubling
intervals and only where cheaper drafts would pay, and the speculator then asks the proposer
nothing; worth_proposing never refuses a step that choose would have speculated on."""

from __future__ import annotations

import random

import pytest

from radixlm.backend.request import Req
from radixlm.backend.sampling_params import SamplingParams
from radixlm.backend.scheduler_config import SchedulerStats, SpeculativeConfig
from radixlm.backend.speculative import Speculator
from radixlm.backend.speculative_policy import (
    EXPLORE_DRAFTS,
    MAX_LEARN_SKIP,
    MAX_REEXPLORE_STEPS,
    MIN_SAMPLES,
    REEXPLORE_STEPS,
    TRUST_FACTOR,
    VERIFY_MIN_SAMPLES,
    SpecPolicy,
    _likeliest,
)


def reqs(n: int) -> list[Req]:
    return [
        Req(rid=str(i), input_ids=[1], params=SamplingParams(), sink=lambda _: None, detok=None)  # type: ignore[arg-type]
        for i in range(n)
    ]


def trained(
    decode_s: float,
    per_draft_s: float,
    batch: int,
    drafts: int,
    fixed_s: float = 0.0,
    fast_rows: int | None = None,
) -> SpecPolicy:
    """Measured: plain steps, then verify steps of drafts and drafts // 2 (as measuring steps
    alternate) costing fixed_s + per_draft_s per draft beside the batch."""
    pol = SpecPolicy(adaptive=True, fast_rows=fast_rows)
    for _ in range(MIN_SAMPLES):
        pol.record(False, batch, 0, decode_s)
    for i in range(MIN_SAMPLES):
        d = drafts if i % 2 == 0 else max(drafts // 2, 1)
        pol.record(True, batch, d, decode_s + fixed_s + per_draft_s * d)
    assert pol.costs.ready(batch)
    return pol


def test_measures_decode_first_then_explores_with_few_drafts():
    pol = SpecPolicy(adaptive=True)
    batch = reqs(8)
    props = [[5, 6, 7, 8] for _ in batch]
    assert not any(pol.choose(batch, props))
    for _ in range(MIN_SAMPLES):
        pol.record(False, 8, 0, 0.1)
    assert sum(len(p) for p in pol.choose(batch, props)) == EXPLORE_DRAFTS


def test_verify_cost_fits_fixed_and_per_draft_parts_per_batch_bucket():
    pol = trained(decode_s=0.015, per_draft_s=0.0055, batch=1, drafts=4, fixed_s=0.011)
    assert abs(pol.costs.fixed(1) - 0.011) < 1e-6 and abs(pol.costs.per_draft(1) - 0.0055) < 1e-6
    assert not pol.costs.ready(8) and pol.costs.per_draft(8) == 0.0  # batch 8 measures its own


def test_fixed_verify_cost_declines_the_first_cheap_looking_drafts():
    """The CPU's batch-1 shape: a verify step leaves the fused decode path (~11 ms before any
    draft, then ~5.5 ms a draft, beside a 15 ms step). At alpha 0.6 no draft count pays (priced
    per draft only, one draft would have looked worth it); at 0.95 all four do."""
    pol = trained(decode_s=0.015, per_draft_s=0.0055, batch=1, drafts=4, fixed_s=0.011)
    (r,) = reqs(1)
    st = pol.state(r)
    st.hits, st.misses = 0.6, 0.4
    assert pol.choose([r], [[1, 2, 3, 4]]) == [[]]
    assert not pol.worth_proposing([r], [4])
    st.hits, st.misses = 0.95, 0.05
    assert pol.choose([r], [[1, 2, 3, 4]]) == [[1, 2, 3, 4]]


def test_measuring_steps_alternate_full_and_half_draft_counts():
    pol = SpecPolicy(adaptive=True)
    batch = reqs(8)
    props = [[5, 6, 7, 8] for _ in batch]
    for _ in range(MIN_SAMPLES):
        pol.record(False, 8, 0, 0.1)
    counts = []
    for _ in range(VERIFY_MIN_SAMPLES):
        assert pol.proposal_limit(8) == EXPLORE_DRAFTS  # the proposer may stop at that many
        n = sum(len(p) for p in pol.choose(batch, props))
        counts.append(n)
        pol.record(True, 8, n, 0.1 + 0.01 * n)
    assert counts == [EXPLORE_DRAFTS, EXPLORE_DRAFTS // 2]  # two counts: fixed and per-draft parts
    assert pol.costs.ready(8) and not pol.costs.ready(1)
    assert pol.proposal_limit(8) is None and abs(pol.costs.per_draft(8) - 0.01) < 1e-9


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


def dear_but_accepted(batch: list[Req]) -> SpecPolicy:
    """Batch 8, drafts accepted often but dear (as beside a batch of 8 on the CPU, where a verify
    step leaves the GEMV kernel): declined, yet drafts at a quarter of the cost would pay."""
    pol = trained(decode_s=0.068, per_draft_s=0.015, batch=8, drafts=8)
    for r in batch:
        for _ in range(5):
            pol.observe(r, 4, 4)
    return pol


def test_remeasures_at_doubling_intervals_while_declining_and_resets_when_drafts_pay():
    batch = reqs(8)
    props = [[1, 2, 3, 4] for _ in batch]
    pol = dear_but_accepted(batch)
    gaps, since = [], 0  # declined steps before each measuring step
    while len(gaps) < 6:
        if any(pol.choose(batch, props)):
            gaps.append(since)
            since = 0
        else:
            since += 1
    expected = [REEXPLORE_STEPS * 2**i for i in range(6)]
    assert gaps == [min(g, MAX_REEXPLORE_STEPS) for g in expected]
    for _ in range(60):  # drafts became cheap (measured by chosen or measuring steps)
        pol.record(True, 8, 8, 0.068 + 0.001 * 8)
    assert any(pol.choose(batch, props))
    assert pol.reexplore_after == REEXPLORE_STEPS and pol.declined == 0


def test_no_remeasure_where_even_cheaper_drafts_would_not_pay():
    batch = reqs(8)
    pol = trained(decode_s=0.068, per_draft_s=0.015, batch=8, drafts=8)
    for r in batch:
        pol.observe(r, 4, 0)
        pol.observe(r, 4, 1)
    for r in batch:  # past any cooldown
        while pol.paused(r):
            pass
    props = [[1, 2, 3, 4] for _ in batch]
    assert not any(any(pol.choose(batch, props)) for _ in range(4 * MAX_REEXPLORE_STEPS))
    assert not pol.worth_proposing(batch, [4] * len(batch))


def policy_for(seed: int, batch: list[Req]) -> SpecPolicy:
    rng = random.Random(seed)
    b = len(batch)
    pol = trained(
        decode_s=rng.uniform(0.01, 0.1), per_draft_s=rng.uniform(0.0, 0.02), batch=b, drafts=rng.randint(1, 8)
    )
    for r in batch:
        for _ in range(rng.randint(0, 4)):
            k = rng.randint(1, 4)
            pol.observe(r, k, rng.randint(0, k))
    pol.declined = rng.choice([0, REEXPLORE_STEPS - 1, REEXPLORE_STEPS, 500])
    return pol


def test_worth_proposing_never_refuses_what_choose_would_speculate_on():
    for seed in range(300):
        rng = random.Random(1000 + seed)
        batch = reqs(rng.choice([1, 2, 8, 16]))
        budgets = [rng.randint(0, 6) for _ in batch]
        proposals = [[7] * rng.randint(0, k) for k in budgets]
        if not policy_for(seed, batch).worth_proposing(batch, budgets):
            assert not any(policy_for(seed, batch).choose(batch, proposals)), seed


class CountingProposer:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, req: Req, k: int) -> list[int]:
        self.calls += 1
        return [5] * k

    def observe_finished(self, req: Req) -> None:
        return None


def counting_speculator(n: int) -> tuple[list[Req], Speculator, CountingProposer]:
    """n n-gram requests and a speculator whose proposer counts its calls."""
    batch = reqs(n)
    for r in batch:
        r.params.speculative_algorithm = "ngram"
        r.params.max_new_tokens = 64
    spec = Speculator(SpeculativeConfig(), None, SchedulerStats(), context_len=4096)  # type: ignore[arg-type]
    spec.proposers["ngram"] = proposer = CountingProposer()
    return batch, spec, proposer


def test_backed_off_speculator_asks_the_proposer_nothing():
    batch, spec, proposer = counting_speculator(8)
    spec.policy = trained(decode_s=0.068, per_draft_s=0.015, batch=8, drafts=8)
    for r in batch:
        spec.policy.observe(r, 4, 0)
        spec.policy.observe(r, 4, 1)
        while spec.policy.paused(r):
            pass
    assert all(spec.draft(batch) is None for _ in range(200))
    assert proposer.calls == 0
    assert spec.policy.declined == 200
    spec.policy = trained(decode_s=0.05, per_draft_s=0.0005, batch=8, drafts=8)
    plan = spec.draft(batch)
    assert plan is not None and proposer.calls == len(batch)


def test_measuring_step_asks_the_proposer_only_for_the_drafts_it_verifies():
    """While a batch size's costs are unknown, a step verifies EXPLORE_DRAFTS drafts: requests are
    asked in order until that many are found, not every request's prompt indexed."""
    batch, spec, proposer = counting_speculator(64)
    for _ in range(MIN_SAMPLES):
        spec.policy.record(False, 64, 0, 0.05)
    plan = spec.draft(batch)
    assert plan is not None and sum(map(len, plan.drafts)) == EXPLORE_DRAFTS
    assert proposer.calls == -(-EXPLORE_DRAFTS // 4)  # four drafts a request


def test_learning_backs_off_while_tries_find_no_drafts():
    """Before a batch size's verify costs are known, every overlapped step is settled for a try at
    drafts; tries that find none space out exponentially (up to MAX_LEARN_SKIP plain steps), and
    a try that finds drafts brings back a try every step."""
    pol = SpecPolicy(adaptive=True)
    for _ in range(MIN_SAMPLES):
        pol.record(False, 64, 0, 0.01)
    assert not pol.costs.ready(64)

    def settled_in(steps: int) -> int:
        return sum(pol.expects_speculation(64) for _ in range(steps))

    assert settled_in(5) == 5
    for fruitless in range(1, 10):
        pol.proposals_found(False)
        skip = min(2**fruitless - 1, MAX_LEARN_SKIP)
        assert [pol.expects_speculation(64) for _ in range(skip + 1)] == [False] * skip + [True]
    pol.proposals_found(True)
    assert settled_in(5) == 5


def test_unmeasured_batch_size_borrows_the_nearest_measured_fit():
    """Verify costs measured at 64 serve 32-63 and 16-31 (a draining batch pays no new round of
    measuring steps), not 8 (too far); a size's own fit replaces the borrowed one once ready."""
    pol = trained(decode_s=0.01, per_draft_s=0.001, batch=64, drafts=8, fixed_s=0.002)
    costs = pol.costs
    assert costs.ready(64) and costs.ready(40) and costs.ready(20)
    assert costs.fixed(40) == costs.fixed(64) and costs.per_draft(20) == costs.per_draft(64)
    assert not costs.ready(8) and costs.fixed(8) == 0.0
    for i in range(MIN_SAMPLES):
        d = 8 if i % 2 == 0 else 4
        pol.record(True, 40, d, costs.decode.predict(40) + 0.004 + 0.003 * d)
    assert abs(costs.per_draft(40) - 0.003) < 1e-6 and abs(costs.per_draft(64) - 0.001) < 1e-6


def test_drafts_capped_below_the_fast_row_limit():
    """With a decode kernel that takes 8 rows (the CPU block kernel), a step of fewer rows keeps its
    verify step within it: the likeliest drafts up to 8 - B, in the adaptive and the fixed policy
    alike, and measuring steps too; from 8 rows on the measured costs alone decide."""
    pol = trained(decode_s=0.010, per_draft_s=0.0002, batch=2, drafts=4, fixed_s=0.0005, fast_rows=8)
    assert pol.draft_cap(1) == 7 and pol.draft_cap(7) == 1 and pol.draft_cap(8) is None
    a, b = reqs(2)
    pol.state(a).hits, pol.state(a).misses = 0.99, 0.01
    pol.state(b).hits, pol.state(b).misses = 0.6, 0.4
    chosen = pol.choose([a, b], [[1] * 7, [2] * 7])
    assert sum(map(len, chosen)) == 6 and len(chosen[0]) >= len(chosen[1])  # the likelier first
    fixed = SpecPolicy(adaptive=False, fast_rows=8)
    assert fixed.choose([a, b], [[1] * 7, [2] * 7]) == [[1] * 6, []]
    assert SpecPolicy(adaptive=False).choose([a, b], [[1] * 7, [2] * 7]) == [[1] * 7, [2] * 7]
    exploring = SpecPolicy(adaptive=True, fast_rows=8)
    for _ in range(MIN_SAMPLES):
        exploring.record(False, 6, 0, 0.01)
    six = reqs(6)
    assert exploring.proposal_limit(6) == 2
    assert sum(map(len, exploring.choose(six, [[3] * 7 for _ in six]))) == 2
    assert sum(map(len, trained(0.01, 0.0001, 8, 8, fast_rows=8).choose(reqs(8), [[4] * 7] * 8))) > 8


def test_draft_count_stays_near_the_counts_measured():
    """A fit measured at 8 and 4 drafts is not trusted for hundreds: however cheap drafts look, a
    step verifies at most TRUST_FACTOR x 8; a verify step that large extends the range."""
    pol = trained(decode_s=0.05, per_draft_s=0.0001, batch=64, drafts=8)
    batch = reqs(64)
    for r in batch:
        pol.state(r).hits, pol.state(r).misses = 0.95, 0.05
    props = [[1] * 7 for _ in batch]
    first = sum(map(len, pol.choose(batch, props)))
    assert first == TRUST_FACTOR * 8
    pol.record(True, 64, first, 0.05 + 0.0001 * first)
    assert sum(map(len, pol.choose(batch, props))) == TRUST_FACTOR * first


def test_likeliest_draft_positions_match_a_full_sort():
    """The policy ranks only the draft positions it may verify (a merge of per-request sequences);
    the values are those a sort of every position gives, and no request gets more than its drafts."""
    rng = random.Random(3)
    for _ in range(200):
        rows = [(rng.random(), rng.randint(0, 7)) for _ in range(rng.randint(1, 12))]
        k = rng.randint(0, 30)
        got = _likeliest(rows, k)
        every = sorted((a ** (j + 1) for a, n in rows for j in range(n)), reverse=True)
        assert [g for g, _ in got] == pytest.approx(every[:k])
        assert all(sum(1 for _, i in got if i == r) <= rows[r][1] for r in range(len(rows)))
        for g, i in got:
            assert any(g == pytest.approx(rows[i][0] ** (j + 1)) for j in range(rows[i][1]))
