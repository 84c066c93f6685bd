"""Overlap scheduling (step t is processed after step t+1 is launched) against the plain
schedule → run → process loop, on CPU with the default model: the same greedy tokens, text,
finish reasons, logprobs and seeded samples; streaming, retraction, abort, and requests whose
sampling needs the previous token (grammar, penalties, min_new_tokens) mixed in; every KV slot
back afterwards; and the launch order that makes it overlap."""

from __future__ import annotations

import json
import random

import pytest

from radixlm.backend.engine import Engine

WORDS = "the cat sat on a mat while birds sang over green hills and rivers ran to the sea".split()


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
)


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(n)]


def mixed_params(n: int, seed: int) -> list[dict]:
    """Lengths 1..20, some stop strings, some stopping at EOS: requests end at different steps,
    including right after their first token, while the next step is already in flight."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        p: dict = {"max_new_tokens": rng.choice([1, 2, 3, 8, 20]), "temperature": 0}
        if k % 3 == 0:
            p["stop"] = [" the", "."]
        if k % 4 != 1:
            p["ignore_eos"] = True
        out.append(p)
    return out


@pytest.fixture(scope="module")
def overlap_engine():
    eng = Engine(overlap_schedule=True)
    assert eng.scheduler.cfg.overlap
    yield eng
    eng.shutdown()


def pool_restored(eng: Engine) -> None:
    assert eng.flush_cache()
    st = eng.get_stats()
    assert st["kv_free_slots"] == st["kv_total_slots"]
    assert st["num_running"] == 0 and st["num_waiting"] == 0 and eng.scheduler.inflight is None


def summary(out: dict) -> tuple:
    return out["output_ids"], out["text"], out["meta_info"]["finish_reason"]


@pytest.mark.slow
def test_mixed_batch_matches_plain(engine, overlap_engine):
    ps, qs = prompts(20, 0), mixed_params(20, 1)
    assert not engine.scheduler.cfg.overlap
    engine.flush_cache()
    plain = [summary(o) for o in engine.generate(ps, qs)]
    overlapped = [summary(o) for o in overlap_engine.generate(ps, qs)]
    assert overlapped == plain
    assert {f["type"] for _, _, f in plain} >= {"length", "stop"}
    pool_restored(overlap_engine)


@pytest.mark.slow
def test_logprobs_and_seeded_sampling_match(engine, overlap_engine):
    ps = prompts(6, 2)
    qs = [
        {"max_new_tokens": 6, "temperature": 0.9, "top_p": 0.9, "seed": 100 + k, "ignore_eos": True}
        for k in range(6)
    ]
    kw = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    engine.flush_cache()
    plain = engine.generate(ps, qs, **kw)
    overlapped = overlap_engine.generate(ps, qs, **kw)
    for a, b in zip(plain, overlapped):
        assert a["output_ids"] == b["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            la, lb = a["meta_info"][key], b["meta_info"][key]
            assert [t for _, t, _ in la] == [t for _, t, _ in lb] and len(la) == len(b["meta_info"][key])
            assert all((x is None and y is None) or abs(x - y) < 1e-4 for (x, _, _), (y, _, _) in zip(la, lb))
        assert [[i for _, i, _ in row] for row in a["meta_info"]["output_top_logprobs"]] == [
            [i for _, i, _ in row] for row in b["meta_info"]["output_top_logprobs"]
        ]
    pool_restored(overlap_engine)


@pytest.mark.slow
@pytest.mark.parametrize("jump_forward", [True, False])
def test_fresh_state_requests_mixed_in_match(engine, overlap_engine, jump_forward):
    """Grammar, penalties and min_new_tokens read the previous token: their step samples only
    after the in-flight step is processed (with jump-forward, a grammar request is not even
    scheduled while its token is in flight), and their outputs stay the plain loop's."""
    saved = engine.disable_jump_forward, overlap_engine.disable_jump_forward
    engine.disable_jump_forward = overlap_engine.disable_jump_forward = not jump_forward
    try:
        _fresh_state_match(engine, overlap_engine)
    finally:
        engine.disable_jump_forward, overlap_engine.disable_jump_forward = saved


def _fresh_state_match(engine, overlap_engine):
    ps = prompts(7, 3)
    qs = [
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0, "regex": "[0-9]{3}-[a-z]{2,4}"},
        {"max_new_tokens": 12, "temperature": 0, "frequency_penalty": 1.5, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0, "min_new_tokens": 5, "stop": ["."]},
        {"max_new_tokens": 12, "temperature": 0, "repetition_penalty": 1.3, "ignore_eos": True},
        {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0, "json_schema": SCHEMA},  # llguidance's pooled masks
    ]
    engine.flush_cache()
    plain = [summary(o) for o in engine.generate(ps, qs)]
    before = overlap_engine.get_stats().get("deferred_sampling_steps", 0)
    overlapped = [summary(o) for o in overlap_engine.generate(ps, qs)]
    assert overlapped == plain
    assert overlap_engine.get_stats().get("deferred_sampling_steps", 0) > before  # the deferred path ran
    pool_restored(overlap_engine)


@pytest.mark.slow
def test_stream_equals_blocking(overlap_engine):
    p, q = "the cat sat on the mat and", {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    whole = overlap_engine.generate(p, q)
    chunks = list(overlap_engine.generate(p, q, stream=True))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


@pytest.mark.slow
def test_tiny_pool_retracts_and_matches(engine):
    ps = prompts(12, 4)
    qs = [{"max_new_tokens": 16, "temperature": 0, "ignore_eos": True} for _ in ps]
    engine.flush_cache()
    alone = [engine.generate(p, q)["output_ids"] for p, q in zip(ps, qs)]
    eng = Engine(max_total_tokens=90, chunked_prefill_size=48, overlap_schedule=True)
    try:
        assert [o["output_ids"] for o in eng.generate(ps, qs)] == alone
        assert eng.get_stats()["num_retractions"] > 0
        pool_restored(eng)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_abort_mid_stream_frees_everything(overlap_engine):
    stream = overlap_engine.generate(
        "rivers ran to the sea and",
        {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
        stream=True,
    )
    bystander = prompts(1, 5)[0]
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(got) == 3:
            break
    stream.close()  # abandoning the stream aborts the request
    out = overlap_engine.generate(bystander, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 5
    for _ in range(50):
        if overlap_engine.get_stats()["num_running"] == 0:
            break
        import time

        time.sleep(0.1)
    pool_restored(overlap_engine)


def launch_order(overlap: bool) -> str:
    """'L' per launched step and 'P' per processed one, for one request decoding 6 tokens."""
    eng = Engine(overlap_schedule=overlap, max_total_tokens=256)
    try:
        events: list[str] = []
        sched = eng.scheduler
        launch, process = sched.launch, sched.process
        sched.launch = lambda plan: (events.append("L"), launch(plan))[1]  # type: ignore[method-assign]
        sched.process = lambda step: (events.append("P"), process(step))[1]  # type: ignore[method-assign]
        eng.generate("the cat", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        return "".join(events)
    finally:
        eng.shutdown()


def test_step_t_plus_1_is_launched_before_step_t_is_processed():
    """Overlap launches every step before processing the previous one; the plain loop alternates."""
    assert launch_order(False) == "LP" * 6
    # the prompt's first token feeds the first decode on the device; the 6th token is known to
    # be the last, so no 7th step is launched for it
    assert launch_order(True) == "L" + "LP" * 5 + "P"
