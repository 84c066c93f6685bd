"""SubmitGate: lets run_batch's concurrent programs reach the engine together. Programs start, and
resume after a shared decode step, a few hundred microseconds apart (each runs its Python under
the GIL), so their calls would arrive one by one and the first would start a prefill step alone.
While none of the lanes' calls is in the engine, the gate holds a call until every lane has one
held, no call has come for `quiet_s`, or the first held call has waited `max_wait_s`, then hands
all held calls to the engine as one arrival. While one is in the engine, the engine is stepping
anyway and takes every call that came during a step into the next: calls go straight through.
Promise: a held call is submitted within `max_wait_s`; with no lanes open (a single run) calls
go straight through."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from radixlm.backend.prepared_call import PreparedCall


class PreparingEngine(Protocol):
    def prepare_generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        rid: str | list[str] | None = None,
        **logprob: Any,
    ) -> PreparedCall: ...

    def submit_prepared(self, calls: list[PreparedCall]) -> None: ...


class SubmitGate:
    def __init__(self, engine: PreparingEngine, quiet_s: float = 0.002, max_wait_s: float = 0.010) -> None:
        self._engine = engine
        self.quiet_s = quiet_s
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._held: list[PreparedCall] = []
        self._first_at = self._last_at = 0.0
        self._lanes = 0  # run_batch lanes still running programs
        self._busy = 0  # the lanes' calls held here or in the engine, not yet answered

    # ---- lanes (run_batch) --------------------------------------------------------------
    def lanes_opened(self, n: int) -> None:
        with self._cond:
            self._lanes += n

    def lane_closed(self) -> None:
        with self._cond:
            self._lanes -= 1
            self._cond.notify_all()  # the held calls may now be every lane's

    # ---- calls --------------------------------------------------------------------------
    def generate(
        self, input_ids: list[list[int]], sampling: dict[str, Any], rid: list[str] | None, **logprob: Any
    ) -> list[dict[str, Any]]:
        call = self._engine.prepare_generate(input_ids, sampling, rid, **logprob)
        with self._cond:
            if self._lanes <= 1:
                self._engine.submit_prepared([call])
            else:
                self._busy += 1
                call.add_done_callback(self._answered)
                self._hold(call)
        out = call.wait()
        return out if isinstance(out, list) else [out]

    @contextmanager
    def direct(self) -> Iterator[None]:
        """A call that goes straight to the engine (a prefix pin) still keeps its lane busy."""
        with self._cond:
            self._busy += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            self._answered()

    def flush(self) -> None:
        """Submit every held call now (before an abort names them)."""
        with self._cond:
            self._submit_held()

    def _answered(self) -> None:
        with self._cond:
            self._busy -= 1

    def _hold(self, call: PreparedCall) -> None:
        """The first held call's thread leads: it alone waits here and submits the held calls; the
        others only wake it (one wake-up per arrival, not one per waiting thread)."""
        now = time.perf_counter()
        self._last_at = now
        self._held.append(call)
        if len(self._held) > 1:
            self._cond.notify_all()
            return
        self._first_at = now
        try:
            while call in self._held:
                wait = self._time_left(time.perf_counter())
                if wait <= 0 or self._busy >= self._lanes or self._busy > len(self._held):
                    self._submit_held()
                else:
                    self._cond.wait(wait)
        except BaseException:  # e.g. Ctrl-C in the leader: the calls it held must not wait for a new one
            self._submit_held()
            raise

    def _time_left(self, now: float) -> float:
        return min(self._last_at + self.quiet_s, self._first_at + self.max_wait_s) - now

    def _submit_held(self) -> None:
        held, self._held = self._held, []
        if held:
            self._engine.submit_prepared(held)
        self._cond.notify_all()


def gate_for(engine: Any) -> SubmitGate | None:
    """A gate for a GPU engine that takes prepared calls (the in-process Engine), else None. On a
    GPU each forward pass streams every weight, so a pass saved outweighs the wait; on a CPU the
    pass costs about its tokens' compute and the wait would only leave the engine idle."""
    device = getattr(engine, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    if callable(getattr(engine, "prepare_generate", None)) and callable(
        getattr(engine, "submit_prepared", None)
    ):
        return SubmitGate(engine)
    return None
