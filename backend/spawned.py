"""Child processes started with the "spawn" method (CUDA cannot be forked): waiting until each has
reached its own code, and the error a caller gets when one dies before that. Promises: a child that
dies while starting is reported as soon as it is gone, not after a rendezvous timeout, with the one
cause that is common and fixable (a script that starts an engine at import time)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event

POLL_S = 0.05
SPAWN_HINT = (
    'children are started with the "spawn" method, which runs the main script again in each of them: '
    "if the script starts an engine at import time, start it under "
    '`if __name__ == "__main__":` (the child\'s own error, if it printed one, is above)'
)


def died_while_starting(proc: BaseProcess, what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} ({proc.name}) exited with status {proc.exitcode} while starting; {SPAWN_HINT}"
    )


def wait_started(procs: Sequence[BaseProcess], started: Sequence[Event], timeout_s: float, what: str) -> None:
    """Block until every procs[i] has set started[i]; RuntimeError as soon as one exits first, or
    once timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    for proc, event in zip(procs, started, strict=True):
        while not event.wait(POLL_S):
            if not proc.is_alive():
                raise died_while_starting(proc, what)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} ({proc.name}) did not start within {timeout_s:.0f} s")
