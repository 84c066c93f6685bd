"""Reused threads for the language's concurrency: each program state's executor loop, the program
bodies of `run_batch`, and a streamed run's body. A task takes an idle thread or starts one; a
thread waits up to `idle_seconds` for its next task, then exits. Unbounded on purpose: a state's
loop may wait on another's (forks, joins), so a bounded pool could deadlock. Reuse only spares a
warm batch of programs from starting a thread per program and per state."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
Task = Callable[[], None]
logger = logging.getLogger(__name__)


class ThreadCache:
    def __init__(self, name: str, idle_seconds: float = 30.0) -> None:
        self.name = name
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Task]] = []  # the inbox of each idle thread

    def run(self, task: Task) -> None:
        """Run `task` on an idle thread, or on a new one when none is idle."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=self.name, daemon=True).start()
        inbox.put(task)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """fn() on a cached thread; its result or exception lands in the returned future."""
        future: Future[T] = Future()

        def task() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to whoever reads the future
                    future.set_exception(e)

        self.run(task)
        return future

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    def _serve(self, inbox: queue.SimpleQueue[Task]) -> None:
        task: Task | None = inbox.get()
        while task is not None:
            try:
                task()
            except BaseException:  # noqa: BLE001 - a task's own bug must not kill a reused thread
                logger.exception("a task on a %s thread raised", self.name)
            del task  # an idle thread must not keep the last task's objects (a program state) alive
            task = self._next_task(inbox)

    def _next_task(self, inbox: queue.SimpleQueue[Task]) -> Task | None:
        """The thread's next task, or None once it has been idle for idle_seconds."""
        with self._lock:
            self._idle.append(inbox)
        try:
            return inbox.get(timeout=self.idle_seconds)
        except queue.Empty:
            with self._lock:
                if any(q is inbox for q in self._idle):
                    self._idle.remove(inbox)
                    return None
            return inbox.get()  # run() took this thread just as it timed out: its task is coming


PROGRAM_THREADS = ThreadCache("radixlm-program")
