"""SlowPhaseWatch: a diagnostic for host pauses. With RADIXLM_SLOW_PHASE_MS set, the scheduler arms
it around its host-only phases (schedule, launch), and a watchdog thread logs the scheduler
thread's Python stack, once per phase, when one runs past the limit. The watchdog reads the stack
under the GIL (sys._current_frames), so it is safe beside running threads; a C call that holds the
GIL for the whole pause is seen as soon as it lets go. Unset, arm and disarm do nothing."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import weakref

logger = logging.getLogger(__name__)

ENV = "RADIXLM_SLOW_PHASE_MS"


class SlowPhaseWatch:
    def __init__(self, limit_ms: float | None = None) -> None:
        if limit_ms is not None and not limit_ms > 0:
            raise ValueError(f"{ENV} must be a positive number of milliseconds, not {limit_ms!r}")
        self.limit_s = None if limit_ms is None else limit_ms / 1e3
        self.reports = 0  # phases that overran and were logged
        self._armed_at: float | None = None
        self._thread_id = 0
        self._reported = True
        self._watchdog: threading.Thread | None = None

    @classmethod
    def from_env(cls) -> SlowPhaseWatch:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return cls()
        try:
            limit = float(raw)
        except ValueError:
            raise ValueError(f"{ENV} must be a positive number of milliseconds, not {raw!r}") from None
        return cls(limit)

    def arm(self) -> None:
        """Start the clock for the calling thread's phase."""
        if self.limit_s is None:
            return
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=_watch, args=(weakref.ref(self), self.limit_s), name="radixlm-slow-phase", daemon=True
            )
            self._watchdog.start()
        self._thread_id = threading.get_ident()
        self._reported = False
        self._armed_at = time.perf_counter()

    def disarm(self) -> None:
        if self.limit_s is not None:
            self._armed_at = None

    def check(self) -> None:
        """Log the armed thread's stack if its phase has overrun and was not reported yet."""
        at, limit = self._armed_at, self.limit_s
        if at is None or limit is None or self._reported or time.perf_counter() - at < limit:
            return
        frame = sys._current_frames().get(self._thread_id)
        if frame is None or self._armed_at != at:  # gone, or the phase ended meanwhile
            return
        self._reported = True
        self.reports += 1
        stack = "".join(traceback.format_stack(frame))
        logger.warning(
            "a scheduler phase has run %.0f ms (limit %.0f ms), at:\n%s",
            (time.perf_counter() - at) * 1e3,
            limit * 1e3,
            stack,
        )


def _watch(ref: weakref.ref[SlowPhaseWatch], limit_s: float) -> None:
    """Check a few times per limit while the watch lives (a weak reference: a stopped engine's
    watch is collected and its thread ends)."""
    while (watch := ref()) is not None:
        watch.check()
        del watch
        time.sleep(limit_s / 4)
