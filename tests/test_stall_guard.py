"""A scheduler that cannot go on (requests wait while locked prefixes hold the KV pool) waits
for a message instead of spinning, and after the stall limit ends the waiting requests with an
abort that says why; a program's gen that the engine aborts fails the program with that reason."""

from __future__ import annotations

import time

import pytest

import radixlm as sgl
from radixlm.backend import stall_guard
from radixlm.backend.engine import Engine
from radixlm.backend.stall_guard import StallGuard


class _Scheduler:
    """What StallGuard reads: has_work, inflight, step, fail_all, kv (unused until a stall)."""

    def __init__(self) -> None:
        self.inflight: object | None = None
        self.waiting = 1
        self.failed: list[str] = []

    def has_work(self) -> bool:
        return self.waiting > 0

    def fail_all(self, message: str) -> None:
        self.failed.append(message)
        self.waiting = 0


def test_only_a_step_without_progress_starts_a_stall_and_a_long_one_fails_the_requests(monkeypatch) -> None:
    sched = _Scheduler()
    guard = StallGuard(sched, abort_after_s=5.0)  # type: ignore[arg-type]
    monkeypatch.setattr(guard, "no_room_message", lambda s: f"stalled {s:.0f} s")
    clock = [100.0]
    monkeypatch.setattr(stall_guard.time, "monotonic", lambda: clock[0])
    guard.observe(progressed=True)
    assert not guard.stalled
    guard.observe(progressed=False)
    assert guard.stalled and not sched.failed
    clock[0] += 4.9
    guard.observe(progressed=False)
    assert guard.stalled and not sched.failed
    guard.observe(progressed=True)  # progress (a message freed room) ends the stall
    assert not guard.stalled
    guard.observe(progressed=False)
    clock[0] += 5.0
    guard.observe(progressed=False)
    assert sched.failed == ["stalled 5 s"] and not guard.stalled
    sched.waiting = 1
    guard.observe(progressed=False)  # another stall, which the client ends by aborting its request:
    sched.waiting = 0  # the loop sees nothing held and calls idle, not step
    guard.idle()
    clock[0] += 60.0
    sched.waiting = 1  # a new request's stall starts its own clock
    guard.observe(progressed=False)
    assert guard.stalled and len(sched.failed) == 1


@pytest.fixture
def small_engine(monkeypatch):
    # long enough that a spinning loop (a core's worth of CPU for the whole stall) stands out from
    # the fixed CPU of admitting the request (about 1.4 s here: a chunk's prefill on two threads)
    monkeypatch.setattr(stall_guard, "STALL_ABORT_S", 3.0)
    eng = Engine(max_total_tokens=2000)
    yield eng
    eng.shutdown()


def _ids(engine: Engine, n: int, offset: int) -> list[int]:
    text = " ".join(f"word{i}" for i in range(offset, offset + 4 * n))
    return engine.tokenizer.encode(text)[:n]


def test_a_request_that_cannot_fit_beside_a_pinned_prefix_is_aborted_with_the_reason(small_engine) -> None:
    pin = small_engine.pin_prefix(_ids(small_engine, 1500, 0))
    ids = _ids(small_engine, 1500, 10000)  # tokenized before the clocks start
    t, cpu = time.monotonic(), time.process_time()
    out = small_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4})
    waited, busy = time.monotonic() - t, time.process_time() - cpu
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "no KV room" in reason["message"] and "1 pinned" in reason["message"]
    assert waited < 30 and busy < 0.5 * waited + 0.5  # the stalled loop waited, it did not spin
    small_engine.unpin_prefix(pin)
    again = small_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4})
    assert again["meta_info"]["finish_reason"]["type"] == "length"


def test_a_gen_the_engine_aborts_fails_its_program(small_engine) -> None:
    pin = small_engine.pin_prefix(_ids(small_engine, 1500, 0))
    document = small_engine.tokenizer.decode(_ids(small_engine, 1500, 10000))

    @sgl.function
    def summary(s, doc):
        s += doc + "\nSummary:" + sgl.gen("summary", max_tokens=4)

    try:
        with pytest.raises(RuntimeError, match="generation aborted: no KV room"):
            summary.run(doc=document, backend=sgl.Runtime(engine=small_engine))
    finally:
        small_engine.unpin_prefix(pin)
