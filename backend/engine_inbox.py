"""EngineInbox: what other threads hand the scheduler thread — requests to add, ids to abort,
calls to run between steps, and the stop — as small typed messages on one queue. Promises: the
scheduler thread applies them in order between steps; after the stop, `refuse_all` answers every
message still queued, so no caller waits forever."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Req
    from .scheduler import Scheduler


@dataclass
class AddRequests:
    """One call's requests, added together: a batch reaches the scheduler whole, so the steps it
    forms do not depend on how fast the scheduler thread woke up."""

    reqs: list[Req]


@dataclass
class AbortRequest:
    rid: str


@dataclass
class RunCall:
    fn: Callable[[], object]
    result: Future[object]


@dataclass
class Stop:
    pass


Message = AddRequests | AbortRequest | RunCall | Stop


class EngineInbox:
    def __init__(self) -> None:
        self._queue: queue.Queue[Message] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False

    def put(self, msg: Message) -> None:
        """Queue `msg`; once closed, requests are refused here (RuntimeError), an abort has
        nothing left to abort and a call gets the error, so nothing waits on a stopped loop."""
        with self._lock:
            if not self._closed:
                self._queue.put(msg)
                return
        if isinstance(msg, AddRequests):
            raise RuntimeError("engine is shut down")
        if isinstance(msg, RunCall):
            msg.result.set_exception(RuntimeError("engine is shut down"))

    def drain(self, scheduler: Scheduler, block: bool) -> bool:
        """Apply every queued message (waiting up to 0.5 s for the first when `block`); False once
        the stop is read."""
        try:
            msg = self._queue.get(timeout=0.5) if block else self._queue.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(msg, Stop):
                return False
            if isinstance(msg, AddRequests):
                for req in msg.reqs:
                    scheduler.add_request(req)
            elif isinstance(msg, AbortRequest):
                scheduler.abort(msg.rid)
            else:
                try:
                    msg.result.set_result(msg.fn())
                except Exception as e:
                    msg.result.set_exception(e)
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                return True

    def refuse_all(self) -> None:
        """After shutdown: close the inbox, then answer what is still queued (requests get an
        abort result, calls an error)."""
        with self._lock:
            self._closed = True
        while True:
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, AddRequests):
                for req in msg.reqs:
                    req.finished_reason = {"type": "abort", "message": "engine shut down"}
                    req.sink({"text": "", "output_ids": [], "meta_info": req.meta_info()})
            elif isinstance(msg, RunCall):
                msg.result.set_exception(RuntimeError("engine is shut down"))
