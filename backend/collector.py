"""Python's cyclic garbage collector while engines run (process-wide, as in vLLM and SGLang): the
started engine's objects are frozen out of full passes, and the collection thresholds are raised
so a busy scheduler does not stop for thousands of young-generation passes. Promises: the
thresholds the process had are restored when the last engine stops; an engine's own cycles are
collected when it stops."""

from __future__ import annotations

import gc

# young generation 100,000 allocations (Python: 700), older generations 5x and 10x Python's
# multipliers: a step of a large batch allocates thousands of containers, and with Python's
# defaults each few hundred of them cost a collector pass on the scheduler thread
RAISED_THRESHOLDS = (100_000, 50, 100)

_saved_thresholds: tuple[int, ...] | None = None


def engine_started() -> None:
    """After an engine's start-up: freeze what exists (the engine's modules, graphs, tokenizer)
    and, for the first running engine, raise the thresholds."""
    global _saved_thresholds
    gc.collect()
    gc.freeze()
    if _saved_thresholds is None:
        _saved_thresholds = gc.get_threshold()
        gc.set_threshold(*RAISED_THRESHOLDS)


def thaw_and_collect() -> None:
    """A stopping engine's objects are in the frozen set: thaw it and collect its cycles."""
    gc.unfreeze()
    gc.collect()


def engine_stopped(others_running: bool) -> None:
    """After thaw_and_collect and the engine's release: the engines still running keep their
    objects frozen (what survived, without a second full pass); the last one restores the
    thresholds."""
    global _saved_thresholds
    if others_running:
        gc.freeze()
    elif _saved_thresholds is not None:
        gc.set_threshold(*_saved_thresholds)
        _saved_thresholds = None
