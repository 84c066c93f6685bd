"""The language's reused threads (dsl/threads.py) and run_batch's lanes: a thread serves the next
task once idle and exits after its idle time, tasks that wait on each other never deadlock, errors
reach whoever reads the future, and a batch never runs more programs at once than its lanes."""

from __future__ import annotations

import threading
import time

import pytest

from radixlm.batch_lanes import run_in_lanes
from radixlm.threads import ThreadCache


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_an_idle_thread_serves_the_next_task_and_exits_after_its_idle_time():
    cache = ThreadCache("test-cache", idle_seconds=0.3)
    first = cache.submit(threading.get_ident).result(timeout=5)
    assert wait_until(lambda: cache.idle_count() == 1)
    second = cache.submit(threading.get_ident).result(timeout=5)
    assert second == first  # reused, not a new thread
    assert wait_until(lambda: cache.idle_count() == 0)  # timed out and left
    assert wait_until(lambda: first not in {t.ident for t in threading.enumerate()})


def test_an_idle_thread_keeps_nothing_of_its_last_task_alive():
    import gc
    import weakref

    class State:
        pass

    cache = ThreadCache("test-cache", idle_seconds=5.0)
    state = State()
    ref = weakref.ref(state)
    cache.submit(lambda held=state: None).result(timeout=5)
    del state
    assert wait_until(lambda: cache.idle_count() == 1)
    gc.collect()
    assert ref() is None


def test_tasks_that_wait_on_each_other_all_run():
    """Unbounded: the second task starts although the first blocks until it runs."""
    cache = ThreadCache("test-cache", idle_seconds=1.0)
    started = threading.Event()
    a = cache.submit(lambda: started.wait(timeout=5))
    b = cache.submit(started.set)
    assert a.result(timeout=5) is True
    b.result(timeout=5)


def test_errors_reach_the_future_and_the_thread_is_reused(caplog):
    cache = ThreadCache("test-cache", idle_seconds=1.0)
    fut = cache.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result(timeout=5)
    assert wait_until(lambda: cache.idle_count() == 1)

    def broken() -> None:
        raise RuntimeError("task bug")

    with caplog.at_level("ERROR", logger="radixlm.threads"):
        cache.run(broken)  # no future: logged, and the thread goes back to the idle list
        assert wait_until(lambda: "task bug" in caplog.text)
    assert wait_until(lambda: cache.idle_count() == 1)
    assert cache.submit(lambda: 7).result(timeout=5) == 7


def test_lanes_bound_concurrency_and_keep_order():
    running, peak, lock = [0], [0], threading.Lock()

    def one(kw: dict) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        if kw["i"] == 5:
            raise ValueError("program 5 failed")
        return kw["i"] * 10

    futures = run_in_lanes(one, [{"i": i} for i in range(12)], lanes=3)  # type: ignore[arg-type]
    assert [f.result(timeout=5) for f in futures[:5]] == [0, 10, 20, 30, 40]
    with pytest.raises(ValueError, match="program 5"):
        futures[5].result(timeout=5)
    assert [f.result(timeout=5) for f in futures[6:]] == [60, 70, 80, 90, 100, 110]
    assert 1 < peak[0] <= 3
