"""SubmitGate: calls of concurrent run_batch lanes reach the engine as one arrival; nothing is held
past its bounds; errors stay with their own call. A fake engine records each submission, and the
real CPU engine checks that prepared calls answer as generate does."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from radixlm.backend.prepared_call import PreparedCall
from radixlm.submit_gate import SubmitGate, gate_for


class RecordingEngine:
    """prepare/submit like the Engine's; answers every submitted call at once with its ids."""

    def __init__(self) -> None:
        self.submissions: list[list[list[int]]] = []
        self.lock = threading.Lock()

    def prepare_generate(
        self, input_ids: Any, sampling_params: Any = None, rid: Any = None, **logprob: Any
    ) -> PreparedCall:
        if input_ids == [[-1]]:
            raise ValueError("bad prompt")
        call = PreparedCall(len(input_ids), single=False)
        call.prompts = input_ids  # type: ignore[attr-defined]
        return call

    def submit_prepared(self, calls: list[PreparedCall]) -> None:
        with self.lock:
            self.submissions.append([c.prompts[0] for c in calls])  # type: ignore[attr-defined]
        for c in calls:
            for k, ids in enumerate(c.prompts):  # type: ignore[attr-defined]
                c.sink_for(k)(
                    {"text": "", "output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}}}
                )


def call_in_thread(gate: SubmitGate, ids: list[int]) -> threading.Event:
    """gate.generate([ids]) on a thread of its own; the event is set once it has its answer."""
    done = threading.Event()
    threading.Thread(target=lambda: (gate.generate([ids], {}, None), done.set()), daemon=True).start()
    return done


def run_lanes(gate: SubmitGate, n: int, start_gap_s: float = 0.0) -> list[list[dict[str, Any]]]:
    results: list[Any] = [None] * n

    def lane(i: int) -> None:
        time.sleep(start_gap_s * i)
        results[i] = gate.generate([[i]], {}, None)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_calls_of_every_lane_arrive_together() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)  # only "every lane is in" may submit
    gate.lanes_opened(6)
    results = run_lanes(gate, 6, start_gap_s=0.01)
    assert [len(s) for s in engine.submissions] == [6]
    assert [r[0]["output_ids"] for r in results] == [[i] for i in range(6)]  # each its own answer


def test_a_quiet_lane_does_not_hold_the_others_past_the_quiet_time() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=0.05, max_wait_s=5.0)
    gate.lanes_opened(3)  # the third lane never calls (busy in its own code)
    t0 = time.perf_counter()
    run_lanes(gate, 2)
    assert time.perf_counter() - t0 < 2.0
    assert sum(len(s) for s in engine.submissions) == 2


def test_arrivals_that_keep_coming_are_cut_off_at_max_wait() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=1.0, max_wait_s=0.05)
    gate.lanes_opened(100)
    run_lanes(gate, 8, start_gap_s=0.02)  # 160 ms of arrivals, each within the quiet time
    assert len(engine.submissions) >= 2
    assert sum(len(s) for s in engine.submissions) == 8


def test_calls_go_straight_through_while_one_is_in_the_engine() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)
    gate.lanes_opened(4)
    with gate.direct():  # a lane's prefix pin is in the engine: it steps anyway
        assert call_in_thread(gate, [5]).wait(5)
    assert engine.submissions == [[[5]]]


def test_a_closing_lane_releases_the_held_calls() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)
    gate.lanes_opened(2)
    done = call_in_thread(gate, [7])
    time.sleep(0.05)
    assert not done.is_set() and engine.submissions == []  # held: the other lane may still call
    gate.lane_closed()
    assert done.wait(5)
    assert engine.submissions == [[[7]]]


def test_an_interrupted_leader_hands_over_what_it_held() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)
    gate.lanes_opened(3)
    plain_wait = gate._cond.wait
    second_in = threading.Event()

    def wait(timeout: float | None = None) -> bool:
        if second_in.is_set():
            raise KeyboardInterrupt
        return plain_wait(timeout)

    gate._cond.wait = wait  # type: ignore[method-assign]
    raised: list[BaseException] = []

    def leader() -> None:
        try:
            gate.generate([[1]], {}, None)
        except KeyboardInterrupt as e:
            raised.append(e)

    first = threading.Thread(target=leader)
    first.start()
    time.sleep(0.05)  # the first call leads and waits for the other lanes
    second_in.set()
    out: list[Any] = []  # the second call's arrival wakes the leader, which is interrupted
    second = threading.Thread(target=lambda: out.extend(gate.generate([[2]], {}, None)), daemon=True)
    second.start()
    first.join(5), second.join(5)
    assert raised and out and out[0]["output_ids"] == [2]
    assert engine.submissions == [[[1], [2]]]


def test_single_lane_and_flush_submit_at_once() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)
    assert gate.generate([[1]], {}, None)[0]["output_ids"] == [1]  # no lanes: straight through
    gate.lanes_opened(2)
    done = call_in_thread(gate, [2])
    time.sleep(0.05)
    gate.flush()  # as an abort does before it names the held call's rid
    assert done.wait(5)
    assert engine.submissions == [[[1]], [[2]]]


def test_a_call_that_fails_to_prepare_leaves_no_count_behind() -> None:
    engine = RecordingEngine()
    gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)
    gate.lanes_opened(2)
    with pytest.raises(ValueError, match="bad prompt"):
        gate.generate([[-1]], {}, None)
    with gate.direct():  # the other lane's prefix pin keeps it busy: the next call goes at once
        t0 = time.perf_counter()
        gate.generate([[3]], {}, None)
    assert time.perf_counter() - t0 < 2.0
    assert engine.submissions == [[[3]]]


def test_gate_only_for_gpu_engines_that_prepare() -> None:
    class Cpu(RecordingEngine):
        device = type("D", (), {"type": "cpu"})()

    class Gpu(RecordingEngine):
        device = type("D", (), {"type": "cuda"})()

    assert gate_for(Cpu()) is None
    assert isinstance(gate_for(Gpu()), SubmitGate)
    assert gate_for(type("Plain", (), {"device": Gpu.device})()) is None


def test_prepared_calls_answer_as_generate_and_start_in_one_step(engine) -> None:
    prompts = [engine.tokenizer.encode(t) for t in ("The sky is", "One, two,", "Paris is the")]
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    expect = [engine.generate(input_ids=p, sampling_params=sampling)["output_ids"] for p in prompts]
    engine.flush_cache()
    calls = [engine.prepare_generate(p, sampling) for p in prompts]
    before = engine.get_stats()["forward_passes"]
    engine.submit_prepared(calls)
    assert [c.wait()["output_ids"] for c in calls] == expect
    # one arrival: the three prompts prefill in one pass, then five decode steps
    assert engine.get_stats()["forward_passes"] - before == 6


def test_a_prepared_call_with_a_rid_in_flight_fails_alone(engine) -> None:
    ids = engine.tokenizer.encode("Hello")
    slow = engine.prepare_generate(ids, {"max_new_tokens": 64, "ignore_eos": True}, rid="twice")
    engine.submit_prepared([slow])
    dup = engine.prepare_generate(ids, {"max_new_tokens": 2}, rid="twice")
    other = engine.prepare_generate(ids, {"max_new_tokens": 2})
    engine.submit_prepared([dup, other])
    with pytest.raises(ValueError, match="already in flight"):
        dup.wait()
    assert other.wait()["meta_info"]["completion_tokens"] == 2
    assert slow.wait()["meta_info"]["completion_tokens"] == 64
    with pytest.raises(ValueError, match="max_new_tokens"):  # validation raises in prepare
        engine.prepare_generate(ids, {"max_new_tokens": -3})
    with pytest.raises(TypeError, match="unexpected keyword argument 'stream'"):  # blocking calls only
        engine.prepare_generate(ids, {"max_new_tokens": 2}, stream=True)


def test_run_batch_through_a_gate_matches_ungated(engine) -> None:
    import radixlm as sgl
    from radixlm.runtime import Runtime

    @sgl.function
    def answer(s, q):
        s += "Q: " + q + "\nA:"
        s += sgl.gen("a", max_tokens=5, ignore_eos=True)

    batch = [{"q": q} for q in ("Why is the sky blue?", "What is two plus two?", "Name a fruit.", "Hi?")]
    plain = [st["a"] for st in answer.run_batch(batch, backend=Runtime(engine=engine), temperature=0)]
    gated = Runtime(engine=engine)
    gated._gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)  # the CPU engine gets none by default
    engine.flush_cache()
    before = engine.get_stats()["forward_passes"]
    assert [st["a"] for st in answer.run_batch(batch, backend=gated, temperature=0)] == plain
    # all four prompts in one prefill pass, then four decode steps
    passes = engine.get_stats()["forward_passes"] - before
    assert passes == 5


def test_an_abort_reaches_a_held_call(engine) -> None:
    from radixlm.runtime import Runtime

    rt = Runtime(engine=engine)
    rt._gate = SubmitGate(engine, quiet_s=60.0, max_wait_s=60.0)
    rt.lanes_opened(2)
    out: list[Any] = []
    ids = engine.tokenizer.encode("Count to ten:")
    t = threading.Thread(target=lambda: out.extend(rt._request([ids], {"max_new_tokens": 200}, rid=["held"])))
    t.start()
    time.sleep(0.1)
    rt.abort(["held"])  # submits the held call first, so the abort finds it
    t.join(10)
    rt.lane_closed(), rt.lane_closed()
    assert out and out[0]["meta_info"]["finish_reason"]["type"] == "abort"


def test_selects_through_a_gate_choose_as_ungated(engine) -> None:
    import radixlm as sgl
    from radixlm.runtime import Runtime

    @sgl.function
    def judge(s, q):
        s += "Question: " + q + "\nIs it a yes/no question? Answer:"
        s += sgl.select("c", choices=[" yes", " no", " maybe"])
        s += sgl.gen("why", max_tokens=3)

    batch = [{"q": q} for q in ("Is water wet?", "What time is it?", "Can fish fly?")]
    plain = answer_rows(judge.run_batch(batch, backend=Runtime(engine=engine), temperature=0))
    gated = Runtime(engine=engine)
    gated._gate = SubmitGate(engine, quiet_s=0.2, max_wait_s=1.0)
    got = answer_rows(judge.run_batch(batch, backend=gated, temperature=0))
    assert [row[:2] for row in got] == [row[:2] for row in plain]
    for row, want in zip(got, plain, strict=True):  # batch shapes differ: the last float bits may too
        assert row[2] == pytest.approx(want[2], abs=1e-3)


def answer_rows(states: list[Any]) -> list[tuple[str, str, list[float]]]:
    return [(st["c"], st["why"], st.get_meta_info("c")["normalized_prompt_logprobs"]) for st in states]
