"""StallGuard: notices when the scheduler can make no progress (requests wait, nothing runs or is
in flight, no step can be planned: the KV pool is held by locked prefixes such as pinned ones or
program forks) and, after STALL_ABORT_S without progress, ends the held requests with an abort
that says why. Promises: a stalled loop blocks on its inbox instead of spinning a core, and a
stall never leaves a caller waiting forever."""

from __future__ import annotations

import logging
import time

from .scheduler import Scheduler

logger = logging.getLogger(__name__)

# Without progress for this long, nothing short of a client releasing a pin can help, and a
# program whose forks wait on the pool holds its own pin: end the waiting requests.
STALL_ABORT_S = 10.0


class StallGuard:
    def __init__(self, scheduler: Scheduler, abort_after_s: float | None = None) -> None:
        self.scheduler = scheduler
        self.abort_after_s = STALL_ABORT_S if abort_after_s is None else abort_after_s
        self.since: float | None = None

    @property
    def stalled(self) -> bool:
        return self.since is not None

    def idle(self) -> None:
        """Nothing held: a stall, if there was one, is over (a later request starts a new clock)."""
        self.since = None

    def step(self) -> None:
        """One scheduler step; records whether it made progress (planned a step or processed one)."""
        sched = self.scheduler
        had_inflight = sched.inflight is not None
        try:
            progressed = sched.step() or had_inflight
        except Exception:  # the step's own requests were aborted; the rest go on
            logger.exception("scheduler step failed")
            progressed = True
        self.observe(progressed)

    def observe(self, progressed: bool) -> None:
        if progressed:  # the loop calls idle, not observe, once nothing is held
            self.since = None
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif now - self.since >= self.abort_after_s:
            message = self.no_room_message(now - self.since)
            logger.warning("%s", message)
            self.scheduler.fail_all(message)
            self.since = None

    def no_room_message(self, seconds: float) -> str:
        kv = self.scheduler.kv
        return (
            f"no KV room to go on for {seconds:.0f} s: {kv.available()} of {kv.allocator.size} slots "
            f"free, {kv.cache.protected_size()} held by locked prefixes ({len(kv.pinned)} pinned, "
            "program forks, requests being prefilled); a larger max_total_tokens or fewer concurrent "
            "programs would fit"
        )
