"""The server's SGLang surface on real uvicorn (127.0.0.1, the session engine): streaming logprobs
in SGLang's shape (in-process and over /generate), server-side tokenization so a RuntimeEndpoint
with no model files runs programs exactly like the in-process Runtime, /get_server_info, /version,
and /docs rendered from assets this server serves itself."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import radixlm as sgl
from radixlm.backend.server import ServerThread, create_app

PROMPT = "Count from one to twenty: one, two, three,"


@pytest.fixture(scope="module")
def srv(engine) -> Iterator[ServerThread]:
    thread = ServerThread(create_app(engine), drain_timeout_s=2.0).start()
    yield thread
    thread.stop()


@sgl.function
def counting(s):
    s += PROMPT
    s += sgl.gen("answer", max_tokens=12, temperature=0, return_logprob=True)


def test_text_async_iter_meta_has_each_chunks_own_logprobs(engine) -> None:
    rt = sgl.Runtime(engine=engine)
    ref = counting.run(backend=rt)
    ref_text, ref_meta = ref["answer"], ref.get_meta_info("answer")

    async def consume() -> tuple[str, list[Any], Any]:
        state = counting.run(backend=rt, stream=True)
        text, logprobs = "", []
        async for chunk, meta in state.text_async_iter("answer", return_meta_data=True):
            text += chunk
            logprobs.extend(meta["output_token_logprobs"])
            assert meta["output_token_logprobs_length"] == len(logprobs)  # the running count
        return text, logprobs, state.get_meta_info("answer")

    text, logprobs, final = asyncio.run(consume())
    assert text == ref_text
    assert [e[1] for e in logprobs] == [e[1] for e in ref_meta["output_token_logprobs"]]
    assert final["output_token_logprobs"] == logprobs  # get_meta_info keeps the whole list
    assert final["output_token_logprobs_length"] == final["completion_tokens"] == 12


def _sse(resp: httpx.Response) -> list[Any]:
    return [
        json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in resp.iter_lines()
        if line.startswith("data: ")
    ]


def test_generate_stream_events_follow_sglang(srv: ServerThread) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
        "return_logprob": True,
    }
    whole = httpx.post(srv.url + "/generate", json=body, timeout=120).json()
    with httpx.stream("POST", srv.url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        events = _sse(r)
    assert events[-1] == "[DONE]"
    previous, logprobs = "", []
    for event in events[:-1]:  # cumulative text, ids and logprobs, as SGLang's default streams
        assert event["text"].startswith(previous)
        previous = event["text"]
        meta = event["meta_info"]
        assert meta["output_token_logprobs"][: len(logprobs)] == logprobs
        logprobs = meta["output_token_logprobs"]
        assert meta["output_token_logprobs_length"] == len(logprobs) == len(event["output_ids"])
        assert [e[1] for e in logprobs] == event["output_ids"]
    assert previous == whole["text"]
    assert [e[1] for e in logprobs] == [e[1] for e in whole["meta_info"]["output_token_logprobs"]]
    assert whole["meta_info"]["output_token_logprobs_length"] == 10


def test_sglang_methods_abort_all_and_e2e_latency(srv: ServerThread) -> None:
    http = httpx.Client(base_url=srv.url, timeout=120)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    out = http.put("/generate", json=body).json()  # SGLang takes PUT as well as POST
    assert out["meta_info"]["completion_tokens"] == 2 and out["meta_info"]["e2e_latency"] > 0
    assert http.get("/flush_cache").status_code == 200
    assert http.post("/abort_request", json={"abort_all": True}).json() == {"abort_all": True, "aborted": 0}
    refused = http.post("/abort_request", json={})
    assert refused.status_code == 400 and "give rid or abort_all" in refused.text
    long = {"text": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    with http.stream("POST", "/generate", json=long) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        assert http.post("/abort_request", json={"abort_all": True}).json()["aborted"] == 1
        last = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"


def test_generate_max_new_tokens_null_runs_to_the_context_end() -> None:
    """SGLang reads an explicit null as no limit but the context (here 140 tokens left); the absent
    key is the default of 128. An engine of its own with a short context, so reaching its end
    takes a short prefill."""
    from radixlm.backend.engine import Engine

    short = Engine(context_length=256, max_total_tokens=1024, quantization="gguf")  # fast CPU decode
    thread = ServerThread(create_app(short), drain_timeout_s=2.0).start()
    try:
        ids = list(range(100, 100 + short.model_config.context_len - 140))  # any distinct ids
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": None, "ignore_eos": True, "temperature": 0},
        }
        out = httpx.post(thread.url + "/generate", json=body, timeout=120).json()
        assert out["meta_info"]["completion_tokens"] == 140
        absent = {"input_ids": ids, "sampling_params": {"ignore_eos": True, "temperature": 0}}
        done = httpx.post(thread.url + "/generate", json=absent, timeout=60).json()
        assert done["meta_info"]["completion_tokens"] == 128
    finally:
        thread.stop()
        short.shutdown()


def test_tokenize_detokenize_chat_template_and_info(srv: ServerThread, engine) -> None:
    tok = engine.tokenizer
    http = httpx.Client(base_url=srv.url, timeout=60)
    out = http.post("/tokenize", json={"prompt": "Hello radix world"}).json()
    assert out["tokens"] == tok.encode("Hello radix world", add_special_tokens=False)
    assert out["count"] == len(out["tokens"])
    batch = http.post("/tokenize", json={"prompt": ["a b", "c"]}).json()["tokens"]
    assert batch == [tok.encode(t, add_special_tokens=False) for t in ("a b", "c")]
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json()["text"] == "Hello radix world"
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
    messages = [{"role": "user", "content": "hi"}]
    text = http.post(
        "/apply_chat_template", json={"messages": messages, "add_generation_prompt": True}
    ).json()
    assert text["text"] == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    info = http.get("/get_server_info").json()
    assert info["version"] == http.get("/version").json()["version"] != ""
    assert info["context_length"] == engine.model_config.context_len and info["has_chat_template"]
    assert not re.search(r"-[0-9a-f]{16}$", info["served_model_name"])  # no conversion-cache hash


def test_docs_page_assets_all_come_from_the_server(srv: ServerThread) -> None:
    page = httpx.get(srv.url + "/docs", timeout=30)
    assert page.status_code == 200
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text) + re.findall(r"url: '([^']+)'", page.text)
    assert refs, page.text
    for ref in refs:
        assert not ref.startswith(("http:", "https:", "//")), f"{ref} is not served locally"
        got = httpx.get(srv.url + ref, timeout=30)
        assert got.status_code == 200 and got.content, ref


def test_openapi_lists_each_method_as_its_own_operation(srv: ServerThread) -> None:
    paths = httpx.get(srv.url + "/openapi.json", timeout=30).json()["paths"]
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert sorted(paths["/generate"]) == ["post", "put"] and sorted(paths["/flush_cache"]) == ["get", "post"]


CLIENT = textwrap.dedent("""
    import json, sys
    sys.modules["transformers"] = None  # no local tokenizer can be loaded in this process
    import radixlm as sgl

    @sgl.function
    def prog(s):
        s += sgl.user("Name a colour and a number.")
        with s.assistant():
            s += "Colour: " + sgl.select("colour", choices=["red", "green", "blue"])
            s += ". Number: " + sgl.gen("n", regex=r"[0-9]{1,2}", max_tokens=4)
        forks = s.fork(2)
        forks += lambda i: f" Fact {i}:"
        forks += sgl.gen("fact", max_tokens=5, stop="\\n")
        forks.join()

    backend = sgl.RuntimeEndpoint(sys.argv[1])
    st = prog.run(backend=backend, temperature=0)
    print("RESULT " + json.dumps({"colour": st["colour"], "n": st["n"], "fact": st["fact"], "text": st.text()}))
""")


def test_endpoint_without_model_files_matches_runtime(srv: ServerThread, engine, tmp_path) -> None:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    proc = subprocess.run([sys.executable, str(script), srv.url], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    remote = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    namespace: dict[str, Any] = {}
    exec(CLIENT.split("backend = ")[0].replace('sys.modules["transformers"] = None', ""), namespace)
    st = namespace["prog"].run(backend=sgl.Runtime(engine=engine), temperature=0)
    assert remote == {"colour": st["colour"], "n": st["n"], "fact": st["fact"], "text": st.text()}
    assert re.fullmatch(r"[0-9]{1,2}", remote["n"]) and remote["colour"] in ("red", "green", "blue")


@sgl.function
def capital(s, country: str):
    s += f"The capital of {country} is"
    s += sgl.gen("city", max_tokens=3, temperature=0)


def test_program_body_error_shows_the_expected_shape(engine) -> None:
    from radixlm.program_host import program_registry

    thread = ServerThread(create_app(engine, programs=program_registry({"capital": capital}))).start()
    try:
        bad = httpx.post(thread.url + "/programs/capital", json={"country": "Japan"}, timeout=60)
        message = bad.json()["error"]["message"]
        assert bad.status_code == 400 and "country: unknown field" in message and '{"args": {' in message
        good = httpx.post(thread.url + "/programs/capital", json={"args": {"country": "Japan"}}, timeout=120)
        assert good.status_code == 200, good.text
    finally:
        thread.stop()


def test_runtime_launch_server_like_sglang(engine) -> None:
    rt = sgl.Runtime(engine=engine, launch_server=True)
    try:
        assert rt.url is not None and httpx.get(rt.url + "/health", timeout=30).status_code == 200
        direct = rt.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0})
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        over_http = httpx.post(rt.url + "/generate", json=body, timeout=120).json()
        assert direct["text"] == over_http["text"] and direct["meta_info"]["completion_tokens"] == 6
    finally:
        rt.shutdown()
    assert rt.url is None
    assert engine.generate(PROMPT, {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1  # still up


def test_error_bodies_use_one_type_vocabulary(engine) -> None:
    from radixlm.backend.server.protocol import ERROR_TYPES
    from radixlm.backend.server.runner import ServerLimits

    thread = ServerThread(create_app(engine, api_key="k", limits=ServerLimits(max_body_bytes=2048))).start()
    auth = {"Authorization": "Bearer k"}
    try:
        cases = [
            ("GET", "/no_such_route", auth, None, 404),
            ("POST", "/generate", auth, {"text": "x", "bogus": 1}, 400),
            ("POST", "/generate", auth, {"text": "x", "sampling_params": {"regex": "("}}, 400),
            ("POST", "/generate", {}, {"text": "x"}, 401),
            ("POST", "/generate", auth, {"text": "x" * 5000}, 413),
            ("GET", "/generate", auth, None, 405),
        ]
        for method, path, headers, body, status in cases:
            r = httpx.request(method, thread.url + path, headers=headers, json=body, timeout=60)
            assert r.status_code == status, (path, r.text)
            kind = r.json()["error"]["type"]
            assert kind in ERROR_TYPES, (path, kind)
        assert {
            httpx.get(thread.url + "/x", headers=auth).json()["error"]["type"],
            httpx.post(thread.url + "/generate", json={"text": "x"}).json()["error"]["type"],
        } == {"not_found_error", "authentication_error"}
    finally:
        thread.stop()


def test_stop_regex_over_generate_and_the_openai_routes(srv: ServerThread) -> None:
    """SGLang's stop_regex in /generate's sampling_params and in an OpenAI body: the same cut as
    the engine makes, and a bad pattern is a 400 naming it."""
    import openai

    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    free = httpx.post(f"{srv.url}/generate", json={"text": PROMPT, "sampling_params": sp}).json()["text"]
    match = re.search(r"\bs\w+", free)
    assert match is not None, f"the model's count changed: {free!r}"
    cut = httpx.post(
        f"{srv.url}/generate", json={"text": PROMPT, "sampling_params": {**sp, "stop_regex": r"\bs\w+"}}
    ).json()
    assert cut["text"] == free[: match.start()]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\bs\w+"}
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    done = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"stop_regex": [r"\bs\w+"]}
    )
    assert done.choices[0].text == free[: match.start()] and done.choices[0].finish_reason == "stop"
    bad = httpx.post(f"{srv.url}/generate", json={"text": PROMPT, "sampling_params": {"stop_regex": "("}})
    assert bad.status_code == 400 and "stop_regex '('" in bad.text
