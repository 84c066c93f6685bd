"""When speculation pays: per-request acceptance estimates (each draft position accepted with
probability alpha, learned from verify results) and measured step costs (a decode step and a
verify step, each fitted as seconds = a + b * tokens). Promises: a draft token is kept only while
its expected gain beats its measured cost, and a step speculates only when the expected tokens
per second beat plain decoding's; with too few measurements it explores, then decides, and it
re-measures after declining for long — only where drafts would pay at a fraction of their measured
cost, and at growing intervals while re-measuring keeps confirming the decline (a measuring step
beside a large batch can cost several plain steps). worth_proposing tells the speculator, before any
proposal is made, when no proposal within the budgets could be chosen, so a backed-off step does
no proposer work."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from .request import Req

MIN_SAMPLES = 3  # step timings of a kind before its cost is trusted
DECAY = 0.95  # weight of older observations (costs drift with lengths and load)
LOW_ALPHA = 0.2  # below this a request pauses speculation for a while
MAX_COOLDOWN = 64  # steps
REEXPLORE_STEPS = 64  # declined steps before one verify step re-measures its cost
MAX_REEXPLORE_STEPS = 1024  # the interval doubles up to this while re-measuring confirms the decline
# A re-measure happens only if drafts would pay at this fraction of the measured per-draft cost:
# a cost that drifted less than that cannot change the decision, so measuring it buys nothing.
REEXPLORE_COST_FRACTION = 0.25
EXPLORE_DRAFTS = 8  # drafts in a measuring step (a large batch's full verify step is costly)


class LinearCost:
    """seconds ≈ a + b * x, by weighted least squares with forgetting (b ≥ 0; with one x seen so
    far, the mean)."""

    def __init__(self) -> None:
        self.n = 0
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, seconds: float) -> None:
        d = DECAY
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * seconds
        self.n += 1

    @property
    def ready(self) -> bool:
        return self.n >= MIN_SAMPLES

    def predict(self, x: float) -> float:
        if self.w == 0:
            return 0.0
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        b = max((self.sxy / self.w - mx * my) / var, 0.0) if var > 1e-6 * max(mx * mx, 1.0) else 0.0
        return max(my + b * (x - mx), 1e-6)


class StepCosts:
    """A plain decode step of B requests costs decode(B); verifying D drafts beside them costs
    decode(B) + per_draft * D, the extra measured against the decode fit (so noise in one kind
    of step cannot make the other look free or absurd)."""

    def __init__(self) -> None:
        self.decode = LinearCost()
        self.per_draft = 0.0
        self.verify_samples = 0

    def add(self, verify: bool, batch: int, drafts: int, seconds: float) -> None:
        if not verify:
            self.decode.add(batch, seconds)
        elif drafts > 0 and self.decode.ready:
            extra = max(seconds - self.decode.predict(batch), 0.0) / drafts
            w = 1.0 if self.verify_samples == 0 else 1 - DECAY
            self.per_draft = (1 - w) * self.per_draft + w * extra
            self.verify_samples += 1

    @property
    def ready(self) -> bool:
        return self.decode.ready and self.verify_samples >= MIN_SAMPLES

    def step(self, batch: int, drafts: int) -> float:
        return self.decode.predict(batch) + self.per_draft * drafts


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
    def __init__(self, adaptive: bool) -> None:
        self.adaptive = adaptive
        self.costs = StepCosts()
        self.hits, self.misses = 1.0, 1.0  # across requests: the prior of a new request
        self.declined = 0  # steps in a row where drafts were possible but plain decode was chosen
        self.reexplore_after = REEXPLORE_STEPS  # declined steps before the next re-measure
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
        choose. Exact: choose's best throughput only grows with more candidate drafts (its gains
        sorted, each kept draft raises tokens per second), so if budgets-long proposals of every
        request cannot pay, no shorter ones can."""
        if not self.adaptive:
            return True
        costs = self.costs
        if not costs.decode.ready:
            return False  # choose measures plain decode first
        if not costs.ready:
            return True  # choose explores
        b = len(batch)
        gains = self._gains(batch, budgets)
        if self._worth(b, gains, costs.per_draft) or self._remeasure_due(b, gains):
            return True
        self.declined += 1
        return False

    def choose(self, batch: list[Req], proposals: list[list[int]]) -> list[list[int]]:
        """Trim each proposal to the drafts worth verifying; all empty when plain decode wins."""
        if not self.adaptive or not any(proposals):
            return proposals
        costs = self.costs
        if not costs.decode.ready:
            return [[] for _ in proposals]  # measure plain decode first
        b = len(batch)
        gains = self._gains(batch, [len(p) for p in proposals])
        if not costs.ready:
            return self._explore(gains, proposals)
        n = self._worth(b, gains, costs.per_draft)
        if n == 0:
            if self._remeasure_due(b, gains):
                self.reexplore_after = min(2 * self.reexplore_after, MAX_REEXPLORE_STEPS)
                return self._explore(gains, proposals)
            self.declined += 1
            return [[] for _ in proposals]
        self.declined, self.reexplore_after = 0, REEXPLORE_STEPS
        keep = [0] * len(proposals)
        for _, i in gains[:n]:
            keep[i] += 1
        return [p[:k] for p, k in zip(proposals, keep)]

    def _gains(self, batch: list[Req], lengths: list[int]) -> list[tuple[float, int]]:
        """(expected tokens, request index) of each draft position, likeliest first: draft j of a
        request is accepted with probability alpha ** (j + 1)."""
        return sorted(
            (
                (self.state(r).alpha ** (j + 1), i)
                for i, (r, n) in enumerate(zip(batch, lengths))
                for j in range(n)
            ),
            reverse=True,
        )

    def _worth(self, b: int, gains: list[tuple[float, int]], per_draft: float) -> int:
        """How many of the sorted drafts to verify beside b decode rows at per_draft seconds each
        (0: plain decode is faster). A draft stays while it adds more tokens than its time is
        worth, i.e. while it raises tokens per second; then the step must beat plain decode."""
        decode = self.costs.decode.predict(b)
        drafts, expected = 0, float(b)
        for gain, _ in gains:
            if gain <= per_draft * expected / (decode + per_draft * drafts):
                break
            drafts, expected = drafts + 1, expected + gain
        if drafts == 0 or expected / (decode + per_draft * drafts) <= b / decode:
            return 0
        return drafts

    def _remeasure_due(self, b: int, gains: list[tuple[float, int]]) -> bool:
        """Declined long enough, and drafts would pay were they much cheaper than measured."""
        return self.declined >= self.reexplore_after and (
            self._worth(b, gains, self.costs.per_draft * REEXPLORE_COST_FRACTION) > 0
        )

    def _explore(self, gains: list[tuple[float, int]], proposals: list[list[int]]) -> list[list[int]]:
        """A measuring step: the likeliest few drafts only (a large batch's full verify step is
        costly)."""
        self.declined = 0
        keep = [0] * len(proposals)
        for _, i in gains[:EXPLORE_DRAFTS]:
            keep[i] += 1
        return [p[:n] for p, n in zip(proposals, keep)]

    def expects_speculation(self, batch_size: int) -> bool:
        """Whether a step of this size is likely to speculate (the scheduler then settles the
        overlapped step first, since drafts extend the requests' real last tokens)."""
        costs = self.costs
        if not self.adaptive or not costs.ready:
            return True
        a = self.alpha
        drafts = batch_size * 2
        expected = batch_size * (1 + a + a * a)
        return expected / costs.step(batch_size, drafts) > batch_size / costs.step(batch_size, 0)
