"""`select` and prompt logprobs agree on every scheduling path: radix cache on/off × overlap
scheduling on/off × fork/no fork × batch 1/16. The reference is the session engine (cache on,
overlap off); each other path runs the same programs on its own small engine."""

from __future__ import annotations

import pytest

import radixlm as sgl

CHOICES = [" yes", " no", " maybe, it depends"]
QUESTIONS = [f"Is {n} an even number?" for n in range(16)]
TOL = 1e-3  # fp32 on CPU: cached vs recomputed prefix KV differ only by rounding


@sgl.function
def judge(s, q):
    s += "Answer the question with yes or no.\nQuestion: " + q + "\nAnswer:"
    s += sgl.select("a", choices=CHOICES)


@sgl.function
def judge_forked(s, q):
    s += "Two graders answer the question.\nQuestion: " + q + "\n"
    forks = s.fork(2)
    forks += lambda i: f"Grader {i + 1}:"
    forks += sgl.select("a", choices=CHOICES)
    forks.join()


def outcome(program: sgl.Program, backend: object, batch: int) -> list[tuple[object, list[float]]]:
    """Per program state: the decision(s) and the normalized prompt logprobs of the choices."""
    if batch == 1:
        states = [program.run(q=QUESTIONS[0], backend=backend)]
    else:
        states = program.run_batch([{"q": q} for q in QUESTIONS[:batch]], backend=backend)
    result = []
    for st in states:
        meta = st.get_meta_info("a")
        metas = meta if isinstance(meta, list) else [meta]
        result.append((st["a"], [x for m in metas for x in m["normalized_prompt_logprobs"]]))
    return result


def assert_same(got: list, ref: list, tol: float) -> None:
    assert len(got) == len(ref)
    for (pick, lps), (ref_pick, ref_lps) in zip(got, ref):
        assert len(lps) == len(ref_lps)
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < tol, (lps, ref_lps)
        assert pick == ref_pick


CASES = [(judge, 1), (judge, 16), (judge_forked, 1), (judge_forked, 16)]


@pytest.fixture(scope="module")
def reference(engine) -> dict[tuple[str, int], list]:
    rt = sgl.Runtime(engine=engine)
    return {(p.__name__, b): outcome(p, rt, b) for p, b in CASES}


@pytest.mark.parametrize(("radix", "overlap"), [(False, False), (True, True), (False, True)])
def test_select_agrees_across_cache_and_overlap(reference, radix: bool, overlap: bool) -> None:
    with sgl.Runtime(disable_radix_cache=not radix, overlap_schedule=overlap, max_total_tokens=8192) as rt:
        for program, batch in CASES:
            assert_same(outcome(program, rt, batch), reference[(program.__name__, batch)], TOL)
        stats = rt.get_stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["kv_free_slots"] + stats["kv_cached_slots"] == stats["kv_total_slots"]


def test_scoring_only_step_on_cuda_waits_for_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that samples nothing (select scoring) still copies logprobs to the host
    asynchronously on CUDA: it must record the event that process() waits on."""
    import torch

    from radixlm.backend.step_output import LaunchedStep, StepPlan

    recorded: list[object] = []

    class FakeEvent:
        def record(self) -> None:
            recorded.append(self)

        def synchronize(self) -> None:
            recorded.remove(self)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    step = LaunchedStep(StepPlan([], [], [], []), [], None, None, [])
    step.seal(torch.device("cuda"))
    assert len(recorded) == 1
    step.wait()
    assert recorded == [] and step.event is None
    cpu_step = LaunchedStep(StepPlan([], [], [], []), [], None, None, [])
    cpu_step.seal(torch.device("cpu"))
    assert cpu_step.event is None
