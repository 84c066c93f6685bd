"""SlowPhaseDump: a diagnostic for host pauses. With RADIXLM_SLOW_PHASE_MS set, the scheduler arms
it around its host-only phases (schedule, launch); one that runs past the limit gets every thread's
Python stack written to stderr by faulthandler's watchdog thread, which needs no GIL, so a C call
holding the GIL is caught where it stands. Unset, arm and disarm do nothing. faulthandler keeps
one watchdog per process: with several engines in one process, the last armed wins."""

from __future__ import annotations

import faulthandler
import os
import sys

ENV = "RADIXLM_SLOW_PHASE_MS"


class SlowPhaseDump:
    def __init__(self, limit_ms: float | None = None) -> None:
        if limit_ms is not None and not limit_ms > 0:
            raise ValueError(f"{ENV} must be a positive number of milliseconds, not {limit_ms!r}")
        self.limit_s = None if limit_ms is None else limit_ms / 1e3

    @classmethod
    def from_env(cls) -> SlowPhaseDump:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return cls()
        try:
            limit = float(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be a positive number of milliseconds, not {raw!r}") from None
        return cls(limit)

    def arm(self) -> None:
        """Start the clock: a dump follows unless disarm comes within the limit."""
        if self.limit_s is not None:
            faulthandler.dump_traceback_later(self.limit_s, file=sys.__stderr__ or sys.stderr)

    def disarm(self) -> None:
        if self.limit_s is not None:
            faulthandler.cancel_dump_traceback_later()
