"""PreparedCall: one blocking generate call's requests between building and answering. The
engine fills each request's slot from the scheduler thread; `wait` hands the caller one dict (or
the list, for a batch call) or raises the call's error, and done-callbacks learn that it ended."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .request import OutputSink, Req


class PreparedCall:
    def __init__(self, n: int, single: bool) -> None:
        self.reqs: list[Req] = []
        self._results: list[dict[str, Any] | None] = [None] * n
        self._left = n
        self._single = single
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def sink_for(self, k: int) -> OutputSink:
        """The sink of request k: a blocking call gets one item per request, its final one."""

        def put(item: dict[str, Any]) -> None:
            if item["meta_info"]["finish_reason"] is None:
                return
            self._results[k] = item
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self._finish()

        return put

    def fail(self, error: BaseException) -> None:
        """The call never reached the scheduler: wait() raises `error`."""
        self._error = error
        self._finish()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """fn() once the call is answered or failed, on the thread that ended it (the scheduler's,
        for an answer: fn must be quick and must not raise); at once if it already ended."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def wait(self) -> dict[str, Any] | list[dict[str, Any]]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        outs = [r for r in self._results if r is not None]
        return outs[0] if self._single else outs

    def _finish(self) -> None:
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()
