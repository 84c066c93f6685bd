"""When speculation pays: per-request acceptance estimates (each draft position accepted with
probability alpha, learned from verify results) and measured step costs (a decode step fitted as
seconds = a + b * batch; what a verify step adds to it fitted as a + b * drafts per batch-size
bucket, since verifying has a fixed cost before any draft: on the CPU a step past 8 rows takes
another pass of the GEMV kernel, past 192 the dequantize path; an unmeasured bucket borrows a near
one's fit). Promises:
a step verifies the number of likeliest drafts that gives the most expected tokens per second, and
only if that beats plain decoding, never more than twice the most its fit has measured nor, below
the decode kernels' row limit (fast_rows), more than keep the step within it; with too few
measurements it explores, then decides, and it re-measures after declining for long — only where
drafts would pay at a fraction of their measured cost, and at growing intervals while re-measuring
keeps confirming the decline (a measuring step beside a large batch can cost several plain steps).
worth_proposing tells the speculator, before any proposal is made, when no proposal within the
budgets could be chosen, so a backed-off step does no proposer work; proposal_limit, how many drafts
a measuring step will keep, so the proposer stops once it found that many."""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass

from .request import Req

MIN_SAMPLES = 3  # plain decode step timings before their cost is trusted
# verify-cost samples of a batch bucket before its fit is trusted: measuring steps alternate full and
# half draft counts, so two give the fixed and the per-draft part; each costs a settled, unoverlapped
# step (at B=64 on an H200 about two plain steps), so a third would cost more than it refines
VERIFY_MIN_SAMPLES = 2
DECAY = 0.95  # weight of older observations (costs drift with lengths and load)
LOW_ALPHA = 0.2  # below this a request pauses speculation for a while
MAX_COOLDOWN = 64  # steps
REEXPLORE_STEPS = 64  # declined steps before one verify step re-measures its cost
MAX_REEXPLORE_STEPS = 1024  # the interval doubles up to this while re-measuring confirms the decline
# A re-measure happens only if drafts would pay at this fraction of the measured per-draft cost:
# a cost that drifted less than that cannot change the decision, so measuring it buys nothing.
REEXPLORE_COST_FRACTION = 0.25
EXPLORE_DRAFTS = 8  # drafts in a measuring step (a large batch's full verify step is costly)
BORROW_BUCKETS = 2  # an unmeasured batch size uses the fit of a measured one up to 4x away
# A step verifies at most this many times the most drafts its cost fit has measured: the fit is a
# line through the counts seen, and far past them a verify step's cost is not (on the CPU a batch
# of 64 measured at 8 drafts would otherwise verify hundreds); each larger step extends the range.
TRUST_FACTOR = 2
MAX_LEARN_SKIP = 64  # steps: the longest wait between tries for drafts while costs are unknown


class LinearCost:
    """seconds ≈ a + b * x, by weighted least squares with forgetting (b ≥ 0; with one x seen so
    far, the mean)."""

    def __init__(self, min_samples: int = MIN_SAMPLES) -> None:
        self.n, self.min_samples = 0, min_samples
        self.max_x = 0.0  # the largest x measured
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, seconds: float) -> None:
        d = DECAY
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * seconds
        self.n += 1
        self.max_x = max(self.max_x, x)

    @property
    def ready(self) -> bool:
        return self.n >= self.min_samples

    @property
    def slope(self) -> float:
        """b (0 until two different x are seen)."""
        if self.w == 0:
            return 0.0
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        return max((self.sxy / self.w - mx * my) / var, 0.0) if var > 1e-6 * max(mx * mx, 1.0) else 0.0

    def predict(self, x: float) -> float:
        if self.w == 0:
            return 0.0
        mx, my = self.sx / self.w, self.sy / self.w
        return max(my + self.slope * (x - mx), 1e-6)


def bucket(batch: int) -> int:
    """Batch sizes whose verify steps cost alike: powers of two (1, 2-3, 4-7, 8-15, ...)."""
    return batch.bit_length()


class StepCosts:
    """A plain decode step of B requests costs decode(B); verifying D ≥ 1 drafts beside them
    costs decode(B) + extra(D), extra fitted per batch bucket as a + b * D against the decode fit
    (so noise in one kind of step cannot make the other look free or absurd). The fixed part a is
    real: on the CPU a verify step of 1 + 1 rows costs ~1.7x a plain batch-1 step, and a batch of
    8 with any draft leaves the 8-row GEMV kernel; a cost proportional to D would price the first
    drafts far too cheaply. Measuring steps alternate full and half draft counts, so a and b are
    both known once a bucket is ready."""

    def __init__(self) -> None:
        self.decode = LinearCost()
        self.extra: dict[int, LinearCost] = {}

    def add(self, verify: bool, batch: int, drafts: int, seconds: float) -> None:
        if not verify:
            self.decode.add(batch, seconds)
        elif drafts > 0 and self.decode.ready:
            fit = self.extra.setdefault(bucket(batch), LinearCost(VERIFY_MIN_SAMPLES))
            fit.add(drafts, max(seconds - self.decode.predict(batch), 0.0))

    def samples(self, batch: int) -> int:
        """Verify steps measured in batch's bucket."""
        fit = self.extra.get(bucket(batch))
        return fit.n if fit is not None else 0

    def _fit(self, batch: int) -> LinearCost | None:
        """batch's verify-cost fit: its bucket's once measured, else the nearest measured bucket
        within BORROW_BUCKETS (a batch that drains through several buckets would otherwise pay
        a round of measuring steps in each; the borrowed fit is replaced once its own is ready)."""
        b = bucket(batch)
        own = self.extra.get(b)
        if own is not None and own.ready:
            return own
        near = [k for k, fit in self.extra.items() if fit.ready and abs(k - b) <= BORROW_BUCKETS]
        return self.extra[min(near, key=lambda k: (abs(k - b), -k))] if near else own

    def ready(self, batch: int) -> bool:
        fit = self._fit(batch)
        return self.decode.ready and fit is not None and fit.ready

    def fixed(self, batch: int) -> float:
        """a: what verifying costs before any draft (extra(D) = fixed + per_draft * D)."""
        fit = self._fit(batch)
        return 0.0 if fit is None else fit.predict(0.0)

    def trusted_drafts(self, batch: int) -> int:
        """Most drafts a verify step beside batch may have on its fit's word (TRUST_FACTOR)."""
        fit = self._fit(batch)
        return int(TRUST_FACTOR * fit.max_x) if fit is not None else 0

    def per_draft(self, batch: int) -> float:
        """b: what each draft adds."""
        fit = self._fit(batch)
        return 0.0 if fit is None else fit.slope

    def step(self, batch: int, drafts: int) -> float:
        if drafts == 0:
            return self.decode.predict(batch)
        return self.decode.predict(batch) + self.fixed(batch) + self.per_draft(batch) * drafts


@dataclass
class Acceptance:
    """One request's acceptance estimate and back-off state."""

    hits: float
    misses: float
    cooldown: int = 0
    next_cooldown: int = 4

    @property
    def alpha(self) -> float:
        return self.hits / max(self.hits + self.misses, 1e-9)


class SpecPolicy:
    """fast_rows: most rows a forward runs at the decode kernels' per-row cost (None: no such
    limit). Below it, a step's drafts are capped so the verify step stays there: past it the CPU
    block kernel runs another pass over the weights (and past its passes' limit dequantizes every
    weight), and one linear cost fit per batch bucket cannot hold that step (measuring steps on
    both sides of it would price every draft count wrong)."""

    def __init__(self, adaptive: bool, fast_rows: int | None = None) -> None:
        self.adaptive = adaptive
        self.fast_rows = fast_rows
        self.costs = StepCosts()
        self.hits, self.misses = 1.0, 1.0  # across requests: the prior of a new request
        self.declined = 0  # steps in a row where drafts were possible but plain decode was chosen
        self.reexplore_after = REEXPLORE_STEPS  # declined steps before the next re-measure
        # while a batch size's costs are unknown, steps tried for drafts that found none in a row,
        # and the overlapped steps to run before the next try
        self.fruitless, self.learn_skip = 0, 0
        self._state: weakref.WeakKeyDictionary[Req, Acceptance] = weakref.WeakKeyDictionary()

    def state(self, req: Req) -> Acceptance:
        st = self._state.get(req)
        if st is None:
            st = self._state[req] = Acceptance(self.alpha, 1 - self.alpha)  # the prior weighs one step
        return st

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def paused(self, req: Req) -> bool:
        """A request whose drafts keep failing sits out a growing number of steps."""
        if not self.adaptive:
            return False
        st = self.state(req)
        if st.cooldown > 0:
            st.cooldown -= 1
            return True
        return False

    def observe(self, req: Req, drafted: int, accepted: int) -> None:
        st = self.state(req)
        miss = 1.0 if accepted < drafted else 0.0
        st.hits, st.misses = DECAY * st.hits + accepted, DECAY * st.misses + miss
        self.hits, self.misses = DECAY * self.hits + accepted, DECAY * self.misses + miss
        if st.alpha < LOW_ALPHA:
            st.cooldown, st.next_cooldown = st.next_cooldown, min(st.next_cooldown * 2, MAX_COOLDOWN)
            st.hits, st.misses = LOW_ALPHA * 2, (1 - LOW_ALPHA) * 2  # a fresh, sceptical start after it
        elif st.alpha > 2 * LOW_ALPHA:
            st.next_cooldown = 4

    def record(self, verify: bool, batch: int, drafts: int, seconds: float) -> None:
        self.costs.add(verify, batch, drafts, seconds)

    def worth_proposing(self, batch: list[Req], budgets: list[int]) -> bool:
        """False when no proposals within budgets (drafts per request) could be chosen this step,
        the step then counting as declined; True when proposals should be made and passed to
        choose. Exact: with n drafts the best choice is the n likeliest, and budgets-long proposals
        make each of those at least as likely, so if they cannot pay, no shorter ones can."""
        if not self.adaptive:
            return True
        costs = self.costs
        if not costs.decode.ready:
            return False  # choose measures plain decode first
        b = len(batch)
        if not costs.ready(b):
            return True  # choose explores
        gains = self._gains(batch, budgets)
        if self._worth(b, gains) or self._remeasure_due(b, gains):
            return True
        self.declined += 1
        return False

    def draft_cap(self, batch_size: int) -> int | None:
        """Most drafts a step of batch_size rows may verify (None: no cap)."""
        if self.fast_rows is None or batch_size >= self.fast_rows:
            return None  # such a step's verify rows leave the kernel whatever the draft count
        return self.fast_rows - batch_size

    def choose(self, batch: list[Req], proposals: list[list[int]]) -> list[list[int]]:
        """Trim each proposal to the drafts worth verifying; all empty when plain decode wins."""
        if not any(proposals):
            return proposals
        if not self.adaptive:
            return _first(proposals, self.draft_cap(len(batch)))
        costs = self.costs
        if not costs.decode.ready:
            return [[] for _ in proposals]  # measure plain decode first
        b = len(batch)
        gains = self._gains(batch, [len(p) for p in proposals])
        if not costs.ready(b):
            return self._explore(b, gains, proposals)
        n = self._worth(b, gains)
        if n == 0:
            if self._remeasure_due(b, gains):
                self.reexplore_after = min(2 * self.reexplore_after, MAX_REEXPLORE_STEPS)
                return self._explore(b, gains, proposals)
            self.declined += 1
            return [[] for _ in proposals]
        self.declined, self.reexplore_after = 0, REEXPLORE_STEPS
        keep = [0] * len(proposals)
        for _, i in gains[:n]:
            keep[i] += 1
        return [p[:k] for p, k in zip(proposals, keep)]

    def _gains(self, batch: list[Req], lengths: list[int]) -> list[tuple[float, int]]:
        """(expected tokens, request index) of the draft positions the step could verify,
        likeliest first: draft j of a request is accepted with probability alpha ** (j + 1). Only
        as many as a measuring step keeps, or the fit trusts, within the draft cap: a batch of
        64 has hundreds of positions, and this runs at every step while the policy declines."""
        b = len(batch)
        k = self.costs.trusted_drafts(b) if self.costs.ready(b) else EXPLORE_DRAFTS
        cap = self.draft_cap(b)
        return _likeliest(
            [(self.state(r).alpha, n) for r, n in zip(batch, lengths)], k if cap is None else min(k, cap)
        )

    def _worth(self, b: int, gains: list[tuple[float, int]], cost_scale: float = 1.0) -> int:
        """How many of the sorted drafts (_gains: already within the trusted range and the cap)
        to verify beside b decode rows (0: plain decode is faster), with the verify step's
        measured extra cost times cost_scale: the n likeliest drafts are the best n, so the count
        with the most expected tokens per second wins, if it beats plain decode."""
        costs = self.costs
        decode = costs.decode.predict(b)
        fixed, per_draft = costs.fixed(b) * cost_scale, costs.per_draft(b) * cost_scale
        best_n, best_rate, expected = 0, b / decode, float(b)
        for n, (gain, _) in enumerate(gains, 1):
            expected += gain
            rate = expected / (decode + fixed + per_draft * n)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def _remeasure_due(self, b: int, gains: list[tuple[float, int]]) -> bool:
        """Declined long enough, and drafts would pay were they much cheaper than measured."""
        return self.declined >= self.reexplore_after and self._worth(b, gains, REEXPLORE_COST_FRACTION) > 0

    def _explore(self, b: int, gains: list[tuple[float, int]], proposals: list[list[int]]) -> list[list[int]]:
        """A measuring step: the likeliest few drafts only (a large batch's full verify step is
        costly); every other one half as many, so the fixed and per-draft costs both show."""
        self.declined = 0
        n = min(EXPLORE_DRAFTS, len(gains))
        if self.costs.samples(b) % 2:
            n = max(n // 2, 1)
        keep = [0] * len(proposals)
        for _, i in gains[:n]:
            keep[i] += 1
        return [p[:k] for p, k in zip(proposals, keep)]

    def proposal_limit(self, batch_size: int) -> int | None:
        """Most drafts this step can verify when known before proposing: a measuring step's count
        while the batch size's costs are unknown (the proposer need not index every request's
        prompt for it); None otherwise."""
        if self.adaptive and self.costs.decode.ready and not self.costs.ready(batch_size):
            return min(EXPLORE_DRAFTS, self.draft_cap(batch_size) or EXPLORE_DRAFTS)
        return None

    def proposals_found(self, found: bool) -> None:
        """After the proposer ran for a step: tries that keep finding no drafts, before costs are
        known, back off exponentially (expects_speculation), so a batch that rarely has drafts
        keeps its overlap while the policy waits to measure."""
        # capped where the skip already is MAX_LEARN_SKIP, so the power stays small
        self.fruitless = 0 if found else min(self.fruitless + 1, MAX_LEARN_SKIP.bit_length())
        self.learn_skip = min(2**self.fruitless - 1, MAX_LEARN_SKIP)

    def expects_speculation(self, batch_size: int) -> bool:
        """Whether a step of this size is likely to speculate (the scheduler then settles the
        overlapped step first, since drafts extend the requests' real last tokens). Before its
        costs are measured, every step is tried unless recent tries found no drafts at all."""
        costs = self.costs
        if not self.adaptive:
            return True
        if not costs.ready(batch_size):
            if self.learn_skip > 0:
                self.learn_skip -= 1
                return False
            return True
        a = self.alpha
        drafts = min(batch_size * 2, self.draft_cap(batch_size) or batch_size * 2)
        expected = batch_size * (1 + a + a * a)
        return expected / costs.step(batch_size, drafts) > batch_size / costs.step(batch_size, 0)


def _likeliest(rows: list[tuple[float, int]], k: int) -> list[tuple[float, int]]:
    """The k largest alpha_i ** (j + 1), j < n_i, over rows (alpha_i, n_i), as (value, row index),
    largest first: each row's values fall with j, so merging the rows finds them without listing
    every position."""
    heap = [(-a, i, 1) for i, (a, n) in enumerate(rows) if n > 0]
    heapq.heapify(heap)
    out: list[tuple[float, int]] = []
    while heap and len(out) < k:
        neg, i, j = heap[0]
        out.append((-neg, i))
        a, n = rows[i]
        if j < n:
            heapq.heapreplace(heap, (neg * a, i, j + 1))
        else:
            heapq.heappop(heap)
    return out


def _first(proposals: list[list[int]], cap: int | None) -> list[list[int]]:
    """proposals cut, in request order, to at most cap drafts in all."""
    if cap is None:
        return proposals
    out = []
    for p in proposals:
        out.append(p[:cap])
        cap -= len(out[-1])
    return out
