"""RunCancel: the backend requests one program run has in flight, so cancelling the run (its
`arun` task cancelled or timed out) aborts them instead of letting them run to max_new_tokens.
Promise: after cancel(), every tracked request has been aborted once and tracking a new one
raises RunCancelled, so the program stops at its next model call."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

AbortRequests = Callable[[list[str]], None]


class RunCancelled(RuntimeError):
    """The program run was cancelled by its caller."""


class RunCancel:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, AbortRequests] = {}
        self.cancelled = False

    @contextmanager
    def tracking(self, rids: list[str], abort: AbortRequests) -> Iterator[None]:
        """While the block runs, cancel() aborts `rids` through `abort`."""
        with self._lock:
            if self.cancelled:
                raise RunCancelled("the program run was cancelled")
            self._live.update(dict.fromkeys(rids, abort))
        try:
            yield
        finally:
            with self._lock:
                for rid in rids:
                    self._live.pop(rid, None)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            live, self._live = self._live, {}
        for rid, abort in live.items():
            abort([rid])
