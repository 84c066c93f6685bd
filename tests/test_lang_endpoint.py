"""The program suite over HTTP: RuntimeEndpoint against a live radixlm server on 127.0.0.1
(native /generate with input_ids), and the OpenAI backend against the same server's
OpenAI-compatible API. References: the same programs on the in-process Runtime."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import test_lang_programs as suite  # the programs, shared with the in-process suite

import radixlm as sgl

KEY = "lang-test-key"
GREEDY = {"temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "radixlm.backend.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--log-level",
        "warning",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read() if proc.stdout else ''}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.3)
        yield base
    finally:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def ep(url, engine):
    backend = sgl.RuntimeEndpoint(url, api_key=KEY, tokenizer=engine.tokenizer)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def local(engine):
    return sgl.Runtime(engine=engine)


@pytest.fixture(scope="module")
def oai_chat(url):
    return sgl.OpenAI("default", base_url=url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai_text(url):
    return sgl.OpenAI("default", base_url=url + "/v1", api_key=KEY, is_chat_model=False, max_retries=0)


# ---- RuntimeEndpoint -------------------------------------------------------------------


def test_endpoint_server_info(ep, engine):
    info = sgl.get_server_info(ep)
    assert info["context_length"] == engine.model_config.context_len
    assert info["internal_states"] == [info["engine_stats"]]


def test_endpoint_needs_the_api_key(url, engine):
    with pytest.raises(ValueError, match="401"):
        sgl.RuntimeEndpoint(url, api_key="wrong", tokenizer=engine.tokenizer)


def test_endpoint_few_shot_batch_matches_in_process(ep, local):
    args = [{"question": "What color is snow?"}, {"question": "What animal barks?"}]
    remote = suite.qa.run_batch(args, backend=ep, **GREEDY)
    here = suite.qa.run_batch(args, backend=local, **GREEDY)
    assert [s["answer"] for s in remote] == [s["answer"] for s in here]
    assert [s.text() for s in remote] == [s.text() for s in here]


def test_endpoint_chat_select_and_tool_loop(ep, local, engine):
    st = suite.chat.run(backend=ep, **GREEDY)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert st.text() == engine.tokenizer.apply_chat_template(msgs, tokenize=False)
    assert st.text() == suite.chat.run(backend=local, **GREEDY).text()

    remote = suite.pick.run(sgl.token_length_normalized, backend=ep)
    here = suite.pick.run(sgl.token_length_normalized, backend=local)
    assert remote["city"] == here["city"]
    got, ref = remote.get_meta_info("city"), here.get_meta_info("city")
    assert got["normalized_prompt_logprobs"] == pytest.approx(ref["normalized_prompt_logprobs"], abs=1e-4)
    texts = [[e[2] for e in row] for row in got["input_token_logprobs"]]  # decoded by the server
    assert texts == [[e[2] for e in row] for row in ref["input_token_logprobs"]] and texts[0][0]

    tools = suite.tool_loop.run(backend=ep, **GREEDY)
    assert all(")" not in tools[f"arg{i}"] for i in range(2))
    assert tools.text() == suite.tool_loop.run(backend=local, **GREEDY).text()


def test_endpoint_react_fork_and_stream(ep, local):
    st = suite.react.run("Who wrote Hamlet?", backend=ep, **GREEDY)
    assert st.text() == suite.react.run("Who wrote Hamlet?", backend=local, **GREEDY).text()
    fr = suite.fruits.run(backend=ep, **GREEDY)
    assert len(fr["fruit"]) == 5
    assert sorted(fr["fruit"]) == sorted(suite.fruits.run(backend=local, **GREEDY)["fruit"])
    streamed = suite.story.run(backend=ep, stream=True, **GREEDY)
    chunks = list(streamed.text_iter("a"))
    assert len(chunks) >= 2 and "".join(chunks) == streamed["a"]
    assert streamed["a"] == suite.story.run(backend=local, **GREEDY)["a"]


def test_endpoint_server_error_reaches_caller_with_line(ep):
    @sgl.function
    def too_long(s):
        s += "Hello"
        s += sgl.gen("x", max_tokens=10**7)

    with pytest.raises(ValueError, match=r"server answered 4\d\d") as info:
        too_long.run(backend=ep)
    assert "test_lang_endpoint.py" in "\n".join(getattr(info.value, "__notes__", []))


# ---- OpenAI backend (non-select parts) -----------------------------------------------------


def test_openai_chat_multi_turn(oai_chat, local):
    st = suite.chat.run(backend=oai_chat, max_new_tokens=4, **GREEDY)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == st["c1"] and msgs[4]["content"] == st["c2"]
    # The first assistant turn sees the same messages as the in-process program.
    assert st["c1"] == suite.chat.run(backend=local, **GREEDY)["c1"]


def test_openai_completion_mode_and_streaming(oai_text, oai_chat, local):
    args = [{"question": "What color is snow?"}]
    remote = suite.qa.run_batch(args, backend=oai_text, **GREEDY)
    assert remote[0]["answer"] == suite.qa.run_batch(args, backend=local, **GREEDY)[0]["answer"]

    @sgl.function
    def streamed(s):
        s += sgl.user("Count to three.")
        s += sgl.assistant(sgl.gen("a", max_tokens=6))

    st = streamed.run(backend=oai_chat, stream=True, **GREEDY)
    assert "".join(st.text_iter("a")) == st["a"]


def test_openai_completion_mode_select_matches_in_process(oai_text, local):
    remote = suite.pick.run(sgl.token_length_normalized, backend=oai_text)
    here = suite.pick.run(sgl.token_length_normalized, backend=local)
    assert remote["city"] == here["city"]
    got, ref = remote.get_meta_info("city"), here.get_meta_info("city")
    assert got["normalized_prompt_logprobs"] == pytest.approx(ref["normalized_prompt_logprobs"], abs=1e-3)


def test_openai_backend_refuses_what_it_cannot_do(oai_chat):
    with pytest.raises(ValueError, match="chat mode"):
        suite.pick.run(sgl.token_length_normalized, backend=oai_chat)

    @sgl.function
    def regex_prog(s):
        s += sgl.user("A number?")
        s += sgl.assistant(sgl.gen("n", regex="[0-9]+"))

    with pytest.raises(ValueError, match="regex"):
        regex_prog.run(backend=oai_chat)
    with pytest.raises(ValueError, match="assistant role"):
        suite.qa.run("Why?", backend=oai_chat)


def test_endpoint_constrained_int_and_typed_json(ep):
    @sgl.function
    def typed(s):
        s += "Legs of a dog: " + sgl.gen_int("n", max_tokens=4) + "\nBob is 41. As JSON: "
        s += sgl.gen("person", json_schema=suite.Person, max_tokens=40)

    st = typed.run(backend=ep, **GREEDY)
    assert isinstance(st["n"], int)
    assert isinstance(st["person"], suite.Person)
    assert st["person"] == suite.Person.model_validate_json(st.text().split("As JSON: ", 1)[1])


def test_openai_chat_typed_gen_uses_response_format(oai_chat):
    @sgl.function
    def typed(s):
        s += sgl.user("Bob is 41 years old. Give his name and age as JSON.")
        s += sgl.assistant(sgl.gen("person", json_schema=suite.Person, max_tokens=40))

    st = typed.run(backend=oai_chat, **GREEDY)
    assert isinstance(st["person"], suite.Person)
    assert st["person"] == suite.Person.model_validate_json(st.messages()[-1]["content"])


def test_cancelling_an_async_run_aborts_it_on_the_server(ep, url):
    """RuntimeEndpoint sends its own request ids, so a cancelled arun aborts its request there
    (3000 tokens would keep the server busy for many seconds)."""
    import asyncio

    @sgl.function
    def story(s):
        s += "Once upon a time"
        s += sgl.gen("story", max_tokens=3000, ignore_eos=True)

    def busy() -> int:
        return httpx.get(url + "/get_load", headers={"Authorization": f"Bearer {KEY}"}).json()[0]["num_reqs"]

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(story.arun(backend=ep))
        deadline = time.monotonic() + 60
        while busy() == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    start = time.monotonic()
    asyncio.run(cancel_midway())  # returns once the run's thread ends: at once if the request was aborted
    assert time.monotonic() - start < 30, "the cancelled run waited for its whole generation"
    deadline = time.monotonic() + 5
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy() == 0, "the cancelled run's request still runs on the server"
