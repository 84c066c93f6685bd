"""End-to-end tests of the HTTP server: a real `python -m radixlm.launch_server` process with
the real Engine (default model, CPU) on a free 127.0.0.1 port, driven by the official openai
client and httpx. References are independent: greedy outputs must agree across single/batch/
stream/input_ids forms, constrained outputs are checked with re.fullmatch and jsonschema,
metrics with prometheus_client's parser."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import launch_server

KEY = "test-key-123"
MAX_PROMPT_TOKENS = 512
MAX_PENDING = 24
PROGRAMS = textwrap.dedent('''
    import radixlm as sgl

    @sgl.function
    def qa(s, question: str, max_tokens: int = 6):
        """Answer a question in a few tokens."""
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0))

    @sgl.function
    def two_steps(s, topic: str):
        s += "Topic: " + topic + "\\nFirst:" + sgl.gen("first", max_tokens=4, temperature=0)
        s += "\\nSecond:" + sgl.gen("second", max_tokens=4, temperature=0)

    @sgl.function
    def story(s, topic: str):
        s += "A long story about " + topic + ":" + sgl.gen("story", max_tokens=300, ignore_eos=True)

    not_a_program = 42
''')
RUN_FILE = textwrap.dedent("""
    import json
    import radixlm as sgl

    @sgl.function
    def hello(s):
        s += "Say hello:" + sgl.gen("out", max_tokens=3, temperature=0)

    state = hello.run()
    print("RESULT " + json.dumps(state["out"]))
""")


class Server:
    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc = proc
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        self.oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)

    def metrics(self) -> dict[str, float]:
        text = self.http.get("/metrics").text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if not sample.labels:
                    out[sample.name] = sample.value
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    progs = tmp_path_factory.mktemp("progs") / "programs.py"
    progs.write_text(PROGRAMS)
    args = ["--api-key", KEY, "--programs", str(progs), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
            "--max-body-bytes", "65536", "--max-pending-requests", str(MAX_PENDING), "--drain-timeout", "3",
            "--log-level", "warning", "--device", "cpu"]  # fmt: skip
    proc, url = launch_server(args, progs.parent / "server.log")
    srv = Server(proc, url)
    yield srv
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def _gen(server: Server, **body: Any) -> Any:
    r = server.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield "[DONE]" if data == "[DONE]" else json.loads(data)


def _grammars_ready() -> bool:
    try:
        from radixlm.grammars import GrammarBackend
    except ImportError:
        return False
    return callable(getattr(GrammarBackend, "compile", None))


needs_grammar = pytest.mark.skipif(
    not _grammars_ready(), reason="radixlm.grammars has no compile function yet"
)
GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPT = "The capital of France is"


# ---------------------------------------------------------------- native API


def test_health_model_info_and_auth(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200  # the one public route
    for path in ("/model_info", "/metrics", "/v1/models", "/programs"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401, path
        assert "API key" in r.json()["error"]["message"]
    wrong = httpx.get(server.url + "/model_info", headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401
    info = server.http.get("/model_info").json()
    assert info == server.http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["context_length"] > MAX_PROMPT_TOKENS
    models = server.oai.models.list()
    assert [m.id for m in models.data] == [info["model_name"]]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert server.http.get("/health_generate").status_code == 200


def test_generate_forms_agree(server: Server) -> None:
    """Greedy output is the same for text, input_ids, batch and stream forms."""
    one = _gen(
        server,
        text=PROMPT,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        return_text_in_logprobs=True,
    )
    meta = one["meta_info"]
    assert meta["completion_tokens"] == len(one["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    prompt_ids = [e[1] for e in meta["input_token_logprobs"]]
    assert len(prompt_ids) == meta["prompt_tokens"]
    out_lp = meta["output_token_logprobs"]
    assert [e[1] for e in out_lp] == one["output_ids"] and all(e[0] <= 0 for e in out_lp)
    assert all(isinstance(e[2], str) for e in out_lp)

    by_ids = _gen(server, input_ids=prompt_ids, sampling_params=GREEDY)
    assert by_ids["output_ids"] == one["output_ids"]
    batch = _gen(server, text=[PROMPT, "Once upon a time"], sampling_params=GREEDY)
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    alone = _gen(server, text="Once upon a time", sampling_params=GREEDY)
    assert batch[1]["output_ids"] == alone["output_ids"]
    ids_batch = _gen(server, input_ids=[prompt_ids, prompt_ids], sampling_params=[GREEDY, GREEDY])
    assert [b["output_ids"] for b in ids_batch] == [one["output_ids"]] * 2

    with server.http.stream(
        "POST", "/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(_sse(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, SGLang-style
    assert chunks[-1]["text"] == one["text"] and chunks[-1]["output_ids"] == one["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_n_and_top_logprobs(server: Server) -> None:
    outs = _gen(
        server, text=PROMPT, sampling_params={**GREEDY, "n": 2}, return_logprob=True, top_logprobs_num=3
    )
    assert len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]
    meta = outs[0]["meta_info"]
    for (lp, tid, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-4  # greedy picks the top token
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)


@needs_grammar
def test_generate_regex(server: Server) -> None:
    pattern = r"(yes|no), [0-9]{1,3}\."
    out = _gen(
        server,
        text="Answer:",
        sampling_params={"regex": pattern, "max_new_tokens": 16, "temperature": 0.8, "seed": 3},
    )
    assert re.fullmatch(pattern, out["text"]), out["text"]


# ---------------------------------------------------------------- OpenAI API


CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]


def test_chat_plain_streamed_and_n(server: Server) -> None:
    plain = server.oai.chat.completions.create(model="x", messages=CHAT, max_tokens=8, temperature=0)
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < plain.usage.completion_tokens <= 8
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    stream = server.oai.chat.completions.create(
        model="x",
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

    two = server.oai.chat.completions.create(model="x", messages=CHAT, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content == choice.message.content for c in two.choices)
    assert two.usage.completion_tokens == 2 * plain.usage.completion_tokens

    sampled = server.oai.chat.completions.create(
        model="x",
        messages=CHAT,
        max_tokens=8,
        n=2,
        stream=True,
        temperature=1.0,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    per_choice: dict[int, list[Any]] = {0: [], 1: []}
    for c in sampled:
        for ch in c.choices:
            if ch.logprobs and ch.logprobs.content:
                per_choice[ch.index] += ch.logprobs.content
    for entries in per_choice.values():
        assert len(entries) == 8
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_continuous_usage_stats_count_each_choice_as_it_streams(server: Server) -> None:
    """SGLang's and vLLM's stream option: every chunk carries its choice's usage so far. The
    reference is the logprob entries streamed so far, one per generated token."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    common: dict[str, Any] = {"model": "x", "max_tokens": 6, "n": 2, "stream": True, "stream_options": opts}
    chat = server.oai.chat.completions.create(
        messages=CHAT, logprobs=True, extra_body={"ignore_eos": True}, **common
    )
    chunks = list(chat)
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (ch,) = c.choices
        seen[ch.index] += len(ch.logprobs.content) if ch.logprobs and ch.logprobs.content else 0
        assert c.usage.completion_tokens == seen[ch.index], (c, seen)
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert seen == {0: 6, 1: 6} and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    completion = server.oai.completions.create(
        prompt=PROMPT, logprobs=1, extra_body={"ignore_eos": True}, **common
    )
    counted = {0: 0, 1: 0}
    for c in list(completion)[:-1]:
        (ch,) = c.choices
        counted[ch.index] += len(ch.logprobs.tokens) if ch.logprobs else 0
        assert c.usage.completion_tokens == counted[ch.index], (c, counted)
    assert counted == {0: 6, 1: 6}

    no_final = {"continuous_usage_stats": True}  # as in SGLang: per-chunk usage, no usage chunk
    last = list(
        server.oai.completions.create(
            model="x", prompt=PROMPT, max_tokens=3, stream=True, stream_options=no_final
        )
    )[-1]
    assert last.choices and last.usage is not None
    plain = list(server.oai.completions.create(model="x", prompt=PROMPT, max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain)


def test_completions_logprobs_and_echo(server: Server) -> None:
    ref = _gen(server, text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 6})
    r = server.oai.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    assert c.text == ref["text"]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == c.text
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and abs(max(top.values()) - chosen) < 1e-4 and token in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    echo = server.oai.completions.create(
        model="x", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True
    )
    e = echo.choices[0]
    assert e.text == PROMPT + ref["text"]
    assert e.logprobs.token_logprobs[0] is None
    assert len(e.logprobs.tokens) == echo.usage.prompt_tokens + 6

    streamed = server.oai.completions.create(
        model="x", prompt=[PROMPT, PROMPT], max_tokens=6, temperature=0, stream=True
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == {0: ref["text"], 1: ref["text"]}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOL_MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@needs_grammar
def test_response_format_json_schema(server: Server) -> None:
    r = server.oai.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].model_extra["radixlm"]["json_schema_valid"] is True
    tags = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "uniqueItems": True}
        },
        "required": ["tags"],
        "additionalProperties": False,
    }
    r = server.oai.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Three tags for Paris, as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "tags", "schema": tags, "strict": True},
        },
    )
    report = r.choices[0].model_extra["radixlm"]  # the keyword a value check holds is named
    assert report["grammar_checked_keywords"] == ["uniqueItems at #/properties/tags"], report
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), tags)
    r = server.oai.chat.completions.create(
        model="x", messages=CHAT, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop"  # sampled keys may run past any budget; greedy ends
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _check_calls(calls: Any, tools: list[dict[str, Any]]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@needs_grammar
def test_tools_required_named_and_auto(server: Server) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    r = server.oai.chat.completions.create(
        model="x",
        messages=TOOL_MSGS,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls, tools)

    named = {"type": "function", "function": {"name": "get_time"}}
    r = server.oai.chat.completions.create(
        model="x", messages=TOOL_MSGS, tools=tools, tool_choice=named, max_tokens=40, n=2, temperature=1.0
    )
    for choice in r.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        _check_calls(choice.message.tool_calls, tools)

    stream = server.oai.chat.completions.create(
        model="x",
        messages=TOOL_MSGS,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        stream=True,
    )
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"])

    history = TOOL_MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    auto = server.oai.chat.completions.create(
        model="x", messages=history, tools=tools, tool_choice="auto", max_tokens=30, temperature=0
    )
    msg = auto.choices[0].message
    if msg.tool_calls:  # the model chose to call: arguments must still validate
        _check_calls(msg.tool_calls, tools)
        assert auto.choices[0].finish_reason == "tool_calls"
    else:
        assert isinstance(msg.content, str) and auto.choices[0].finish_reason in ("stop", "length")

    # auto, with a few-shot history of calls: greedy SmolLM2 writes the tag, and the call JSON
    # that follows is generated under the call schema (both parallel forms, plain and streamed)
    shots = []
    for city in ("Rome", "Oslo", "Lima"):
        shots += [
            {"role": "user", "content": f"Weather in {city}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": city, "unit": "c"}),
                        },
                    }
                ],
            },
        ]
    shots.append({"role": "user", "content": "Weather in Paris?"})
    for parallel in (False, True):
        r = server.oai.chat.completions.create(
            model="x",
            messages=shots,
            tools=tools,
            tool_choice="auto",
            parallel_tool_calls=parallel,
            max_tokens=40,
            temperature=0,
        )
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        _check_calls(r.choices[0].message.tool_calls, tools)
    stream = server.oai.chat.completions.create(
        model="x", messages=shots, tools=tools, tool_choice="auto", max_tokens=40, temperature=0, stream=True
    )
    calls = [tc for ch in stream if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [c.function.arguments for c in calls] == [r.choices[0].message.tool_calls[0].function.arguments]

    # max_tokens bounds the text before the tag and the call together: two tokens short of the
    # whole call, the call is cut off
    short = r.usage.completion_tokens - 2
    cut = server.oai.chat.completions.create(
        model="x", messages=shots, tools=tools, tool_choice="auto", max_tokens=short, temperature=0
    )
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    assert cut.usage.completion_tokens <= short


# ---------------------------------------------------------------- programs and metrics


def test_programs_list_and_run(server: Server) -> None:
    listing = server.http.get("/programs").json()["programs"]
    by_name = {p["name"]: p for p in listing}
    assert set(by_name) == {"qa", "two_steps", "story"}
    args = {a["name"]: a for a in by_name["qa"]["arguments"]}
    assert args["question"]["required"] and not args["max_tokens"]["required"]
    assert args["max_tokens"]["default"] == 6 and by_name["qa"]["doc"].startswith("Answer")

    r = server.http.post("/programs/qa", json={"args": {"question": "What is 2+2?"}})
    assert r.status_code == 200, r.text
    out = r.json()
    answer = out["variables"]["answer"]
    assert isinstance(answer, str) and answer in out["text"]
    assert "What is 2+2?" in out["text"]
    assert out["meta_info"]["answer"]["completion_tokens"] <= 6

    with server.http.stream(
        "POST", "/programs/two_steps", json={"args": {"topic": "cats"}, "stream": True}
    ) as s:
        events = list(_sse(s.iter_lines()))
    assert events[-1] == "[DONE]" and events[-2]["done"] is True
    final = events[-2]["variables"]
    for var in ("first", "second"):
        streamed = "".join(e["delta"] for e in events[:-2] if e.get("variable") == var)
        assert streamed == final[var]
    again = server.http.post("/programs/two_steps", json={"args": {"topic": "cats"}}).json()
    assert again["variables"] == final  # greedy: streaming does not change the result

    assert server.http.post("/programs/nope", json={"args": {}}).status_code == 404
    assert server.http.post("/programs/not_a_program", json={"args": {}}).status_code == 404
    bad = server.http.post("/programs/qa", json={"args": {"question": "x", "evil": "__import__('os')"}})
    assert bad.status_code == 400 and "evil" in bad.json()["error"]["message"]
    missing = server.http.post("/programs/qa", json={"args": {}})
    assert missing.status_code == 400 and "question" in missing.json()["error"]["message"]


HI = "Hi there, how are you doing today?"


def test_metrics_parse(server: Server) -> None:
    before = server.metrics()
    with server.http.stream(
        "POST",
        "/generate",
        json={"text": HI, "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
    ) as r:
        list(r.iter_lines())
    _gen(server, text=HI, sampling_params={"max_new_tokens": 4, "ignore_eos": True})  # now prefix-cached
    m = server.metrics()
    for name in (
        "radixlm_num_running_requests",
        "radixlm_num_waiting_requests",
        "radixlm_kv_free_slots",
        "radixlm_kv_total_slots",
        "radixlm_kv_usage",
        "radixlm_radix_hit_rate",
        "radixlm_retractions_total",
        "radixlm_inter_token_latency_seconds_count",
    ):
        assert name in m, name
    assert (
        m["radixlm_time_to_first_token_seconds_count"]
        == before["radixlm_time_to_first_token_seconds_count"] + 1
    )
    assert (
        m["radixlm_e2e_request_latency_seconds_count"]
        >= before["radixlm_e2e_request_latency_seconds_count"] + 2
    )
    assert m["radixlm_generation_tokens_total"] == before["radixlm_generation_tokens_total"] + 8
    # the engine's own first-token histogram: both requests, streamed or not, within the server's TTFT
    engine_count = "radixlm_engine_time_to_first_token_seconds_count"
    assert m[engine_count] == before.get(engine_count, 0) + 2
    assert m["radixlm_engine_time_to_first_token_seconds_sum"] > before.get(
        "radixlm_engine_time_to_first_token_seconds_sum", 0
    )
    assert m["radixlm_prompt_tokens_total"] > before["radixlm_prompt_tokens_total"]
    assert m["radixlm_cached_prompt_tokens_total"] > before["radixlm_cached_prompt_tokens_total"]
    assert 0 < m["radixlm_radix_hit_rate"] < 1
    assert 0 <= m["radixlm_kv_free_slots"] <= m["radixlm_kv_total_slots"]


# ---------------------------------------------------------------- errors and limits


def _error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    for w in words:
        assert w.lower() in message.lower(), message


def test_error_cases_keep_serving(server: Server) -> None:
    h = server.http
    _error(
        h.post("/generate", content=b'{"text": "a",', headers={"content-type": "application/json"}),
        400,
        "malformed JSON",
    )
    _error(
        h.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokenz": 3}}),
        400,
        "max_new_tokenz",
        "unknown field",
    )
    _error(h.post("/v1/chat/completions", json={"messages": CHAT, "temprature": 0.5}), 400, "temprature")
    _error(h.post("/generate", json={"text": "a", "input_ids": [1]}), 400, "exactly one")
    _error(h.post("/generate", json={"text": "a", "sampling_params": {"regex": "(unclosed"}}), 400)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    _error(h.post("/v1/chat/completions", json={"messages": CHAT, "response_format": bad_schema}), 400)
    _error(h.post("/generate", json={"text": "word " * (MAX_PROMPT_TOKENS + 10)}), 400, "limit")
    _error(
        h.post("/generate", json={"input_ids": [1] * 8, "sampling_params": {"max_new_tokens": 10**6}}),
        400,
        "max_new_tokens",
    )
    _error(h.post("/generate", json={"input_ids": [10**9]}), 400, "vocabulary")
    _error(
        h.post("/generate", content=b"x" * 70000, headers={"content-type": "application/json"}),
        413,
        "exceeds",
    )
    _error(
        h.post(
            "/v1/chat/completions",
            json={
                "messages": CHAT,
                "tool_choice": {"type": "function", "function": {"name": "ghost"}},
                "tools": [WEATHER_TOOL],
            },
        ),
        400,
        "ghost",
    )
    _error(
        httpx.post(server.url + "/generate", json={"text": "a"}, headers={"Authorization": "Bearer bad"}), 401
    )
    with pytest.raises(openai.BadRequestError, match="logit_bias: token id 999999 is outside the vocabulary"):
        server.oai.completions.create(model="x", prompt="a", max_tokens=4, logit_bias={"999999": 2.0})
    assert h.get("/health_generate").status_code == 200
    assert (
        _gen(server, text="Still alive?", sampling_params={"max_new_tokens": 2, "ignore_eos": True})[
            "meta_info"
        ]["completion_tokens"]
        == 2
    )


def test_request_errors_are_statuses_streamed_or_not(server: Server) -> None:
    """A request refused while starting gets its 4xx before any event, streamed or not, and is not
    counted as a client abort; a lone surrogate escape anywhere in the body is a 400 naming the
    field (the tokenizer and the response encoder cannot take one)."""
    h = server.http
    aborts = server.metrics()["radixlm_client_aborted_requests_total"]
    lone = "hi \\ud800"  # JSON text: a backslash-u escape with no pair
    for path, body, field in [
        ("/v1/completions", f'{{"model": "m", "prompt": "{lone}", "max_tokens": 2}}', "prompt"),
        ("/v1/chat/completions", f'{{"model": "m", "messages": [{{"role": "user", "content": "{lone}"}}]}}', "messages[0].content"),
        ("/generate", f'{{"text": "ok", "rid": "{lone}", "stream": true}}', "rid"),
    ]:  # fmt: skip
        r = h.post(path, content=body.encode(), headers={"content-type": "application/json"})
        _error(r, 400, field, "surrogate")
    encoded = b'{"messages": [{"role": "user", "content": "hi \xed\xa0\x80"}]}'  # a surrogate's UTF-8 form
    r = h.post("/v1/chat/completions", content=encoded, headers={"content-type": "application/json"})
    _error(r, 400, "not valid UTF-8")
    deep = b'{"text": "\\ud800", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert h.post("/generate", content=deep, headers={"content-type": "application/json"}).status_code == 400
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError):
        server.oai.chat.completions.create(model="m", messages=CHAT, response_format=bad_schema, stream=True)  # type: ignore[arg-type,call-overload]
    bad_regex = {"text": "a", "stream": True, "sampling_params": {"regex": "(unclosed"}}
    _error(h.post("/generate", json=bad_regex), 400)
    with pytest.raises(openai.BadRequestError):
        server.oai.completions.create(
            model="m", prompt="a", max_tokens=2, stream=True, extra_body={"regex": "(unclosed"}
        )
    _error(h.post("/generate", json={"text": []}), 400, "empty batch")
    name = h.get("/v1/models").json()["data"][0]["id"]
    assert h.get(f"/v1/models/{name}").json()["id"] == name
    _error(h.get("/v1/models/no-such-model"), 404, "does not exist")
    assert server.metrics()["radixlm_client_aborted_requests_total"] == aborts
    with h.stream("POST", "/generate", json={"text": PROMPT, "stream": True, "sampling_params": GREEDY}) as r:
        chunks = list(_sse(r.iter_lines()))
    assert chunks[-1] == "[DONE]" and chunks[-2]["meta_info"]["finish_reason"] is not None


def test_overload_gives_503_with_retry_after(server: Server) -> None:
    body = {"text": "Count to ten:", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}

    def one(_: int) -> httpx.Response:
        return server.http.post("/generate", json=body)

    with ThreadPoolExecutor(2 * MAX_PENDING) as pool:
        results = list(pool.map(one, range(2 * MAX_PENDING)))
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
    for r in results:
        if r.status_code == 503:
            assert r.headers["Retry-After"].isdigit() and "overloaded" in r.json()["error"]["message"]
        else:
            assert r.json()["meta_info"]["completion_tokens"] == 6
    assert server.metrics()["radixlm_rejected_requests_total"] >= codes.count(503)
    ok = _gen(server, text="ok", sampling_params={"max_new_tokens": 1, "ignore_eos": True})
    assert ok["meta_info"]["completion_tokens"] == 1


def _wait_idle(server: Server, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = m["radixlm_num_running_requests"] == 0 and m["radixlm_num_waiting_requests"] == 0
        if (
            idle
            and m["radixlm_server_pending_requests"] == 0
            and server.http.post("/flush_cache").status_code == 200
        ):
            return server.metrics()
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_disconnects_abort_and_free_kv(server: Server) -> None:
    start = _wait_idle(server)
    assert start["radixlm_kv_free_slots"] == start["radixlm_kv_total_slots"]
    n_clients = 20

    def drop_midway(i: int) -> int:
        path, body = (
            "/generate",
            {
                "text": f"Story {i}:",
                "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            },
        )
        if i % 2:
            path, body = (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": f"Story {i}"}],
                    "stream": True,
                    "max_tokens": 400,
                    "ignore_eos": True,
                },
            )
        seen = 0
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            with c.stream("POST", path, json=body) as r:
                for line in r.iter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break  # leaving the block closes the connection mid-stream
        return seen

    with ThreadPoolExecutor(n_clients) as pool:
        assert list(pool.map(drop_midway, range(n_clients))) == [3] * n_clients
    end = _wait_idle(server)
    assert (
        end["radixlm_client_aborted_requests_total"] - start["radixlm_client_aborted_requests_total"]
        == n_clients
    )
    assert (
        end["radixlm_engine_aborted_requests_total"] - start["radixlm_engine_aborted_requests_total"]
        == n_clients
    )
    finished = end["radixlm_engine_finished_requests_total"] - start["radixlm_engine_finished_requests_total"]
    generated = end["radixlm_generation_tokens_total"] - start["radixlm_generation_tokens_total"]
    assert generated < n_clients * 400 and finished <= n_clients  # nobody ran to the end
    assert end["radixlm_kv_free_slots"] == start["radixlm_kv_free_slots"]


def test_program_disconnects_abort_the_run(server: Server) -> None:
    """A client leaving a program run (streamed or not) aborts the run's engine request."""
    start = _wait_idle(server)
    with server.http.stream("POST", "/programs/story", json={"args": {"topic": "rain"}, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 2:
                break
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/programs/story", json={"args": {"topic": "snow"}}, timeout=3)
    end = _wait_idle(server)
    assert end["radixlm_engine_aborted_requests_total"] - start["radixlm_engine_aborted_requests_total"] == 2
    assert end["radixlm_generation_tokens_total"] - start["radixlm_generation_tokens_total"] < 2 * 300
    assert end["radixlm_kv_free_slots"] == start["radixlm_kv_free_slots"]


def test_abort_request_by_rid(server: Server) -> None:
    body = {
        "text": "Tell a long story:",
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }
    events: list[Any] = []
    with server.http.stream("POST", "/generate", json=body) as r:
        for event in _sse(r.iter_lines()):
            events.append(event)
            if len(events) == 2:
                assert server.http.post("/abort_request", json={"rid": "abort-me"}).json()["found"] is True
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-2]["meta_info"]["completion_tokens"] < 400
    assert server.http.post("/abort_request", json={"rid": "abort-me"}).json()["found"] is False


# ---------------------------------------------------------------- CLI and shutdown


def test_cli_run_program_file(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`radixlm run FILE --url URL`: the file runs as __main__ with the server as default backend."""
    from radixlm.cli import main

    f = tmp_path / "hello.py"
    f.write_text(RUN_FILE)
    main(["run", str(f), "--url", server.url, "--api-key", KEY])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT "))
    value = json.loads(line[len("RESULT ") :])
    ref = _gen(server, text="Say hello:", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert value == ref["text"]  # same greedy tokens through the program backend
    with pytest.raises(SystemExit):
        main(["bogus"])
    with pytest.raises(SystemExit):
        main(["run", str(tmp_path / "missing.py")])


def test_graceful_shutdown_drains_then_aborts(server: Server) -> None:
    """SIGTERM: a short request still finishes, a long one ends with finish_reason abort after
    the drain timeout (3 s), and the process exits cleanly. Runs last: it stops the server."""
    results: dict[str, Any] = {}

    def stream(name: str, max_new: int) -> None:
        body = {
            "text": f"{name}:",
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        }
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            with c.stream("POST", "/generate", json=body) as r:
                results[name] = list(_sse(r.iter_lines()))

    threads = [
        threading.Thread(target=stream, args=("short", 6)),
        threading.Thread(target=stream, args=("long", 3000)),
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["radixlm_num_running_requests"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(60)
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown: -15 is a clean exit here
    assert server.proc.wait(60) in (0, -signal.SIGTERM)
    assert time.monotonic() - t0 < 30
    assert results["short"][-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert results["long"][-1] == "[DONE]"
    assert results["long"][-2]["meta_info"]["finish_reason"]["type"] == "abort"
