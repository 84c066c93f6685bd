"""SGLang frontend signatures a ported program calls: run's use_thread and n. On the session's
shared engine (CPU, default model)."""

from __future__ import annotations

import asyncio

import pytest

import radixlm as sgl

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def rt(engine):
    return sgl.Runtime(engine=engine)


@sgl.function
def hello(s):
    s += "Hello, my name is" + sgl.gen("a", max_tokens=3)


def test_run_takes_sglangs_use_thread_and_it_changes_no_result(rt):
    reference = hello.run(backend=rt, **GREEDY).text()
    assert hello.run(backend=rt, use_thread=False, **GREEDY).text() == reference
    assert hello.run(backend=rt, use_thread=True, **GREEDY).text() == reference
    streamed = hello.run(backend=rt, use_thread=False, stream=True, **GREEDY)
    assert "".join(streamed.text_iter()) == reference
    assert asyncio.run(hello.arun(backend=rt, use_thread=False, **GREEDY)).text() == reference
    with pytest.raises(ValueError, match="use_thread must be True or False"):
        hello.run(backend=rt, use_thread="no")


def test_run_and_run_batch_take_n_1_and_refuse_more(rt):
    reference = hello.run(backend=rt, **GREEDY).text()
    assert hello.run(backend=rt, n=1, **GREEDY).text() == reference
    assert [st.text() for st in hello.run_batch([{}, {}], backend=rt, n=1, **GREEDY)] == [reference] * 2
    with pytest.raises(ValueError, match=r"run\(n=2\) is not supported: fork"):
        hello.run(backend=rt, n=2)
    with pytest.raises(ValueError, match=r"run\(n=3\) is not supported: fork"):
        hello.run_batch([{}], backend=rt, n=3)
