"""run_batch's concurrency: how many programs run at once (SGLang's num_threads, "auto" as its
default), and the lanes that run them, in order, with an optional tqdm progress bar.
Promise: results come back in the batch's order; at most `lanes` programs run at once."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from radixlm.threads import PROGRAM_THREADS

S = TypeVar("S")  # what one run returns (a ProgramState)


class LaneWatcher(Protocol):
    """Told how many lanes run programs at once, and when each stops (the program backend)."""

    def lanes_opened(self, n: int) -> None: ...

    def lane_closed(self) -> None: ...


def num_threads_for(num_threads: int | str, n: int) -> int:
    if num_threads == "auto":
        num_threads = max(64, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive int, got {num_threads!r}")
    return max(1, min(num_threads, n))


def run_all(
    one: Callable[[dict[str, Any]], S],
    batch: list[dict[str, Any]],
    threads: int,
    progress_bar: bool,
    watcher: LaneWatcher | None = None,
) -> Iterator[S]:
    pbar = None
    if progress_bar:
        import tqdm

        pbar = tqdm.tqdm(total=len(batch))
    try:
        if threads == 1:
            for kw in batch:
                yield one(kw)
                if pbar is not None:
                    pbar.update()
            return
        futures = run_in_lanes(one, batch, threads, watcher)
        if pbar is not None:
            for f in futures:
                f.add_done_callback(lambda _: pbar.update())
        for f in futures:
            yield f.result()
    finally:
        if pbar is not None:
            pbar.close()


def run_in_lanes(
    one: Callable[[dict[str, Any]], S],
    batch: list[dict[str, Any]],
    lanes: int,
    watcher: LaneWatcher | None = None,
) -> list[Future[S]]:
    """One future per kwargs dict, in order; `lanes` cached threads each run the next program
    not yet started until none is left, so at most `lanes` run at once."""
    futures: list[Future[S]] = [Future() for _ in batch]
    order = iter(range(len(batch)))
    lock = threading.Lock()

    def lane() -> None:
        try:
            while True:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                if futures[i].set_running_or_notify_cancel():
                    try:
                        futures[i].set_result(one(batch[i]))
                    except BaseException as e:  # noqa: BLE001 - re-raised by whoever reads the future
                        futures[i].set_exception(e)
        finally:
            if watcher is not None:
                watcher.lane_closed()

    n = min(lanes, len(batch))
    if watcher is not None:
        watcher.lanes_opened(n)
    for _ in range(n):
        PROGRAM_THREADS.run(lane)
    return futures
