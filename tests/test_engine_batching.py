"""Continuous batching invariants: 32 concurrent requests of mixed lengths give the same greedy
tokens as one at a time — also with a KV pool too small for them all (retraction) and with
chunked prefill — and every KV slot comes back afterwards."""

from __future__ import annotations

import random
import time

import pytest

from radixlm.backend.engine import Engine

WORDS = "the cat sat on a mat while birds sang over green hills and rivers ran to the sea".split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]


def params(n: int) -> list[dict]:
    rng = random.Random(1)
    return [{"max_new_tokens": rng.randint(4, 24), "temperature": 0, "ignore_eos": True} for _ in range(n)]


@pytest.fixture(scope="module")
def reference(engine):
    prompts = make_prompts(32)
    ps = params(32)
    engine.flush_cache()
    alone = [engine.generate(p, q)["output_ids"] for p, q in zip(prompts, ps)]
    return prompts, ps, alone


def _check_pool_restored(eng: Engine) -> None:
    assert eng.flush_cache()
    st = eng.get_stats()
    assert st["kv_free_slots"] == st["kv_total_slots"]
    assert st["num_running"] == 0 and st["num_waiting"] == 0


@pytest.mark.slow
def test_concurrent_equals_one_at_a_time(engine, reference):
    prompts, ps, alone = reference
    engine.flush_cache()
    together = [o["output_ids"] for o in engine.generate(prompts, ps)]
    assert together == alone
    _check_pool_restored(engine)


@pytest.mark.slow
@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_tiny_pool_retracts_and_still_matches(reference, disable_radix_cache):
    prompts, ps, alone = reference
    eng = Engine(max_total_tokens=100, chunked_prefill_size=64, disable_radix_cache=disable_radix_cache)
    try:
        outs = eng.generate(prompts, ps)
        assert [o["output_ids"] for o in outs] == alone
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert eng.get_stats()["num_retractions"] > 0
        _check_pool_restored(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_chunked_prefill_matches(reference):
    prompts, ps, alone = reference
    eng = Engine(chunked_prefill_size=8)
    try:
        outs = eng.generate(prompts[:8], ps[:8])
        assert [o["output_ids"] for o in outs] == alone[:8]
        _check_pool_restored(eng)
    finally:
        eng.shutdown()


def test_a_generate_call_reaches_the_scheduler_whole(engine):
    """The requests of one generate() call are added between the same two steps, so the batches
    they form do not depend on when the scheduler thread woke up (a prefill of only the first
    few, then the rest, would change every later batch and its rounding)."""
    sched = engine.scheduler
    seen: list[int] = []
    step = sched.step

    def recording_step() -> bool:
        seen.append(len(sched.waiting) + len(sched.running))
        return step()

    inbox, put = engine._inbox, engine._inbox.put

    def slow_put(msg: object) -> None:  # a busy caller thread: the scheduler wakes between messages
        put(msg)  # type: ignore[arg-type]
        time.sleep(0.005)

    sched.step = recording_step  # type: ignore[method-assign]
    inbox.put = slow_put  # type: ignore[method-assign]
    try:
        engine.flush_cache()
        for _ in range(5):
            seen.clear()
            engine.generate(make_prompts(12, seed=3), [{"max_new_tokens": 2, "temperature": 0}] * 12)
            assert seen and seen[0] == 12, seen[:4]
    finally:
        del sched.step, inbox.put
