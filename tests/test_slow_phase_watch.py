"""SlowPhaseWatch: its environment switch, one logged stack when an armed phase overruns and none
when it is disarmed in time, and the scheduler arming it around its schedule phase."""

from __future__ import annotations

import logging
import time

import pytest

from radixlm.backend.engine import Engine
from radixlm.backend.slow_phase_watch import ENV, SlowPhaseWatch
from radixlm.backend.step_output import StepPlan


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert SlowPhaseWatch.from_env().limit_s is None
    monkeypatch.setenv(ENV, "25")
    assert SlowPhaseWatch.from_env().limit_s == pytest.approx(0.025)
    for bad in ("abc", "0", "-3"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            SlowPhaseWatch.from_env()


def overrunning_phase() -> None:
    time.sleep(0.3)


def test_an_overrun_logs_the_stack_once_and_a_phase_in_time_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "radixlm.backend.slow_phase_watch")
    watch = SlowPhaseWatch(20)
    watch.arm()
    watch.disarm()
    time.sleep(0.1)
    assert watch.reports == 0
    watch.arm()
    overrunning_phase()  # many checks pass while it runs: one report
    watch.disarm()
    assert watch.reports == 1
    assert "overrunning_phase" in caplog.text and "limit 20 ms" in caplog.text
    off = SlowPhaseWatch()
    off.arm()
    time.sleep(0.05)
    assert off.reports == 0 and off._watchdog is None


def test_the_scheduler_arms_it_around_schedule(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "radixlm.backend.slow_phase_watch")
    sched = engine.scheduler
    original = sched.schedule

    def slow_schedule() -> StepPlan | None:
        time.sleep(0.05)
        return original()

    watch = SlowPhaseWatch(10)
    monkeypatch.setattr(sched, "slow_phase", watch)
    monkeypatch.setattr(sched, "schedule", slow_schedule)
    engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
    monkeypatch.undo()
    assert watch.reports >= 1
    assert "slow_schedule" in caplog.text and "scheduler.py" in caplog.text
