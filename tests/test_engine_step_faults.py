"""A fault inside one step's sampling (a grammar matcher or the sampler raising) ends the affected
requests with the error, frees their KV and leaves the engine serving; a matcher that raises ends
only its own request, while the rest of its batch completes."""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from radixlm.grammars.fsm import FSMMatcher

BOUND_S = 120.0  # a fault that leaves a request unanswered fails here instead of hanging the suite


def bounded(fn: Callable[[], Any]) -> Any:
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=BOUND_S)
    finally:
        pool.shutdown(wait=False)


def test_a_raising_grammar_matcher_ends_only_its_request(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = FSMMatcher.fill_next_token_bitmask

    def flaky(self: FSMMatcher, bitmask: Any, row: int) -> None:
        if self._g.regex == "(ab)+c" and len(self._stack) > 2:
            raise RuntimeError("injected matcher fault")
        real(self, bitmask, row)

    monkeypatch.setattr(FSMMatcher, "fill_next_token_bitmask", flaky)
    assert engine.flush_cache()
    free0 = engine.get_stats()["kv_free_slots"]
    params = [{"regex": r, "max_new_tokens": 12, "temperature": 0} for r in ("(ab)+c", "[xy]+z")]
    bad, good = bounded(lambda: engine.generate(["Say it:", "Say it:"], params))
    reason = bad["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "injected matcher fault" in reason["message"]
    assert reason["message"].startswith("grammar error")
    if good["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch(r"[xy]+z", good["text"])
    else:
        assert re.fullmatch(r"[xy]*", good["text"]) and len(good["output_ids"]) == 12
    assert engine.flush_cache()
    assert engine.get_stats()["kv_free_slots"] == free0
    monkeypatch.undo()
    again = bounded(lambda: engine.generate("Say it:", params[0]))
    assert re.fullmatch(r"(ab)+c", again["text"]) or again["meta_info"]["finish_reason"]["type"] == "length"


def test_a_fault_in_deferred_sampling_aborts_its_step_and_the_engine_goes_on(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """min_new_tokens makes a step sample after the previous one is processed; a fault there used
    to leave the request neither sampled nor finished."""
    sampler = engine.scheduler.sampler
    real = sampler._mask_early_stop

    def flaky(logits: Any, reqs: Any) -> bool:
        if any(len(r.output_ids) == 2 for r in reqs):
            raise RuntimeError("injected sampler fault")
        return real(logits, reqs)

    monkeypatch.setattr(sampler, "_mask_early_stop", flaky)
    assert engine.flush_cache()
    free0 = engine.get_stats()["kv_free_slots"]
    sp = {"max_new_tokens": 8, "min_new_tokens": 6, "temperature": 0}
    out = bounded(lambda: engine.generate("Count to ten:", sp))
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "injected sampler fault" in reason["message"]
    monkeypatch.undo()
    assert engine.flush_cache()
    assert engine.get_stats()["kv_free_slots"] == free0
    ok = bounded(lambda: engine.generate("Count to ten:", sp))
    assert ok["meta_info"]["completion_tokens"] == 8
