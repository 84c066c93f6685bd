"""Misuse of the Engine and the language gets a ValueError (or TypeError) with the reason, never a
hang or a neighbour's abort: out-of-range top_logprobs_num, request ids in flight twice, ids given
as tensors or booleans, wrong argument types, sizes that cannot work, a shutdown while a request's
grammar compiles, and a streamed program whose body raises after queuing a gen."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import numpy as np
import pytest
import torch

import radixlm as sgl
from radixlm.backend import engine_requests
from radixlm.backend.engine import Engine

GREEDY = {"max_new_tokens": 4, "temperature": 0}


def test_top_logprobs_num_beyond_the_vocabulary_is_refused(engine):
    with pytest.raises(ValueError, match=r"top_logprobs_num must be an integer in \[0, 49152\]"):
        engine.generate("Hi", GREEDY, return_logprob=True, top_logprobs_num=60000)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate("Hi", GREEDY, return_logprob=True, top_logprobs_num=True)


def test_a_request_id_is_in_flight_once(engine):
    long = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    first = engine.generate("Once", long, rid="dup", stream=True)  # submitted when this returns
    with pytest.raises(ValueError, match="'dup' is already in flight"):
        engine.generate("Again", GREEDY, rid="dup")
    chunks = list(first)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"  # not aborted by the refusal
    assert sum(len(c["output_ids"]) for c in chunks) == 60
    assert engine.generate("Again", GREEDY, rid="dup")["meta_info"]["finish_reason"] is not None
    with pytest.raises(ValueError, match="rid must differ"):
        engine.generate(["a", "b"], GREEDY, rid=["x", "x"])
    with pytest.raises(ValueError, match="rid must be one non-empty string per prompt"):
        engine.generate("a", GREEDY, rid=5)


def test_ids_as_arrays_work_and_wrong_types_are_refused(engine):
    ids = engine.tokenizer.encode("The capital of France is")
    want = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    assert engine.generate(input_ids=torch.tensor(ids), sampling_params=GREEDY)["output_ids"] == want
    assert engine.generate(input_ids=np.array([ids]), sampling_params=GREEDY)[0]["output_ids"] == want
    with pytest.raises(ValueError, match="token id True is outside the vocabulary"):
        engine.generate(input_ids=[True, False], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="sampling_params must be a dict"):
        engine.generate("Hi", 5)


@pytest.mark.parametrize(
    "option,value",
    [
        ("max_running_requests", 0),
        ("max_total_tokens", -5),
        ("chunked_prefill_size", 0),
        ("context_length", 0),
    ],
)
def test_engine_sizes_that_cannot_work_are_refused(option, value):
    with pytest.raises(ValueError, match=f"{option} must be a positive integer"):
        Engine(**{option: value})


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_a_size_that_zero_turns_off_is_refused_below_zero(value):
    with pytest.raises(
        ValueError, match=r"piecewise_cuda_graph_max_tokens must be a non-negative integer \(0: off"
    ):
        Engine(piecewise_cuda_graph_max_tokens=value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_a_cuda_device_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        Engine(device="cuda")


def test_shutdown_while_a_grammar_compiles_fails_the_call_instead_of_hanging(monkeypatch):
    eng = Engine()
    compile_wait = engine_requests.wait_grammars

    def shut_down_meanwhile(reqs):
        compile_wait(reqs)
        eng.shutdown()  # as another thread would, while this caller waited for its grammar

    monkeypatch.setattr(engine_requests, "wait_grammars", shut_down_meanwhile)
    result: list[BaseException] = []

    def call() -> None:
        try:
            eng.generate("JSON:", {"max_new_tokens": 8, "json_schema": {"type": "object"}})
        except RuntimeError as e:
            result.append(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "generate hung after the engine shut down"
    assert result and "engine is shut down" in str(result[0])
    with pytest.raises(RuntimeError, match="shut down"):
        eng.encode("x")
    with pytest.raises(ValueError, match="shut down"):
        sgl.Runtime(engine=eng)


def test_a_streamed_program_that_raises_after_a_gen_ends_its_readers(engine):
    @sgl.function
    def prog(s):
        s += "Q: 2+2?\nA:"
        s += sgl.gen("a", max_tokens=8)
        raise RuntimeError("bug after the gen")

    state = prog.run(backend=sgl.Runtime(engine=engine), stream=True)
    seen: list[BaseException] = []

    def read() -> None:
        try:
            list(state.text_iter("a"))
        except RuntimeError as e:
            seen.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "text_iter waited for a gen that will never run"
    assert seen and "bug after the gen" in str(seen[0])


def test_language_misuse_is_refused_with_the_reason(engine):
    @sgl.function
    def prog(s):
        s += "x"
        s.fork(True)

    rt = sgl.Runtime(engine=engine)
    with pytest.raises(ValueError, match="fork size must be a positive int"):
        prog.run(backend=rt)
    with pytest.raises(TypeError, match=r"radixlm.Runtime\(engine=engine\)"):
        prog.run(backend=engine)


def _aborted_soon(engine, before: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if engine.get_stats()["num_aborted"] > before:
            return True
        time.sleep(0.05)
    return False


def test_a_stream_dropped_unread_aborts_its_request(engine):
    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    before = engine.get_stats()["num_aborted"]
    stream = engine.generate("Once upon a time", long, stream=True)
    del stream
    gc.collect()
    assert _aborted_soon(engine, before), "a dropped stream ran on"

    async def drop_async() -> None:
        agen = await engine.async_generate("Once upon a time", long, stream=True)
        del agen

    before = engine.get_stats()["num_aborted"]
    asyncio.run(drop_async())
    gc.collect()
    assert _aborted_soon(engine, before), "a dropped async stream ran on"


@sgl.function
def _long_story(s):
    s += "Once upon a time"
    s += sgl.gen("story", max_tokens=3000, ignore_eos=True)


@pytest.mark.parametrize("batch", [False, True])
def test_cancelling_an_async_run_aborts_its_model_calls(engine, batch):
    rt = sgl.Runtime(engine=engine)
    before = engine.get_stats()["num_aborted"]

    async def cancel_midway() -> None:
        call = _long_story.arun_batch([{}], backend=rt) if batch else _long_story.arun(backend=rt)
        task = asyncio.ensure_future(call)
        deadline = time.monotonic() + 30
        while engine.get_stats()["num_running"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert _aborted_soon(engine, before), "the cancelled run's gen ran on"


def test_sglang_engine_keywords_are_taken_when_off_and_refused_with_a_reason(engine) -> None:
    params = {"max_new_tokens": 2, "temperature": 0}
    ref = engine.generate("Hi", params)
    off = engine.generate(
        prompt="Hi",
        sampling_params=params,
        image_data=None,
        lora_path=None,
        custom_logit_processor=None,
        return_hidden_states=False,
        token_ids_logprob=None,
        data_parallel_rank=0,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_logprob=None,
    )
    assert off["output_ids"] == ref["output_ids"]
    with pytest.raises(ValueError, match="image_data='x.png': multimodal inputs are not supported"):
        engine.generate("Hi", params, image_data="x.png")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        engine.generate("Hi", params, no_such_option=1)


def test_logprob_options_one_per_prompt_as_sglang_takes_them(engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 3}
    both = engine.generate(
        ["One, two,", "The sky is"], params, return_logprob=[True, False], top_logprobs_num=[2, 0]
    )
    alone = engine.generate("One, two,", params, return_logprob=True, top_logprobs_num=2)
    assert both[0]["output_ids"] == alone["output_ids"]
    assert [e[1] for e in both[0]["meta_info"]["output_token_logprobs"]] == alone["output_ids"]
    assert [len(row) for row in both[0]["meta_info"]["output_top_logprobs"]] == [2, 2, 2]
    assert "output_token_logprobs" not in both[1]["meta_info"]
    with pytest.raises(ValueError, match="return_logprob has 3 values for 2 prompts"):
        engine.generate(["a", "b"], params, return_logprob=[True, False, True])
    with pytest.raises(ValueError, match="logprob_start_len must be an integer"):
        engine.generate(["a", "b"], params, return_logprob=True, logprob_start_len=[0, "1"])
    with pytest.raises(ValueError, match="top_logprobs_num must be an integer"):
        engine.generate(["a", "b"], params, top_logprobs_num=[1, -1])
    with pytest.raises(ValueError, match="return_logprob must be True or False"):
        engine.generate(["a", "b"], params, return_logprob=[True, 1])


def test_a_string_rid_names_a_batch_as_sglang_does(engine) -> None:
    outs = engine.generate(["a", "b"], {"max_new_tokens": 1}, rid="batch-rid")
    assert [o["meta_info"]["id"] for o in outs] == ["batch-rid_0", "batch-rid_1"]
