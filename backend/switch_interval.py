"""The interpreter's GIL switch interval while engines run (process-wide, as collector.py's GC
thresholds): every torch op and Triton launch on the scheduler thread releases the GIL, and at
Python's 5 ms interval a busy thread beside it (an event loop reading streams, program threads,
an engine process's outbox) can hold each reacquisition for up to 5 ms, hundreds of times per
eager forward. Promises: lowered while an engine runs, never raised; the process's own interval
restored when the last engine stops."""

from __future__ import annotations

import sys

# A greedy batch of the default model on two CPU cores beside an always-busy Python thread takes
# 19x its time alone at 5 ms and about 4x at 0.5 or 0.2 ms (benchmarks/gil_switch_interval.py).
SWITCH_INTERVAL_S = 0.0002

_saved_interval: float | None = None


def engine_started() -> None:
    """Before an engine's scheduler thread starts: the first running engine lowers the interval."""
    global _saved_interval
    if _saved_interval is None:
        _saved_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(_saved_interval, SWITCH_INTERVAL_S))


def engine_stopped(others_running: bool) -> None:
    """After an engine stops: the last one gives the process its own interval back."""
    global _saved_interval
    if not others_running and _saved_interval is not None:
        sys.setswitchinterval(_saved_interval)
        _saved_interval = None
