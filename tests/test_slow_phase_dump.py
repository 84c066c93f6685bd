"""SlowPhaseDump: its environment switch, a dump of the stacks when an armed phase overruns and
none when it is disarmed in time, and the scheduler arming it around its schedule phase."""

from __future__ import annotations

import faulthandler
import time

import pytest

from radixlm.backend.engine import Engine
from radixlm.backend.slow_phase_dump import ENV, SlowPhaseDump
from radixlm.backend.step_output import StepPlan


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert SlowPhaseDump.from_env().limit_s is None
    monkeypatch.setenv(ENV, "25")
    assert SlowPhaseDump.from_env().limit_s == pytest.approx(0.025)
    for bad in ("abc", "0", "-3"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            SlowPhaseDump.from_env()


def overrunning_phase() -> None:
    time.sleep(0.3)


def test_an_overrun_dumps_the_stacks_and_a_phase_in_time_does_not(capfd: pytest.CaptureFixture[str]) -> None:
    dump = SlowPhaseDump(20)
    dump.arm()
    dump.disarm()
    time.sleep(0.1)
    assert "Timeout" not in capfd.readouterr().err
    dump.arm()
    overrunning_phase()
    dump.disarm()
    err = capfd.readouterr().err
    assert "Timeout" in err and "overrunning_phase" in err
    SlowPhaseDump().arm()  # off: no watchdog
    time.sleep(0.05)
    assert capfd.readouterr().err == ""


def test_the_scheduler_arms_it_around_schedule(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    sched = engine.scheduler
    original = sched.schedule

    def slow_schedule() -> StepPlan | None:
        time.sleep(0.05)
        return original()

    monkeypatch.setattr(sched, "slow_phase", SlowPhaseDump(10))
    monkeypatch.setattr(sched, "schedule", slow_schedule)
    engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
    monkeypatch.undo()
    faulthandler.cancel_dump_traceback_later()  # one the scheduler may have armed meanwhile
    err = capfd.readouterr().err
    assert "slow_schedule" in err and "scheduler.py" in err
