"""What the official openai client sends and expects, on real uvicorn (127.0.0.1, the session
engine): explicit nulls mean the default, a response's message goes back into `messages` as the
client dumps it, invalid bodies are a 400 (BadRequestError) naming the field, tool schemas are
checked under tool_choice "none" too, and an auto-mode answer keeps the text before its call and
never repeats the call tag."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from server_helpers import openai_on_thread

from radixlm.backend.server.tools import TOOL_CALL_TAG

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    with openai_on_thread(engine) as c:
        yield c


def test_explicit_nulls_mean_the_defaults(client: openai.OpenAI) -> None:
    nulls: Any = None
    r = client.chat.completions.create(
        model="m",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        n=nulls,
        logprobs=nulls,
        stream=nulls,
        parallel_tool_calls=nulls,
        extra_body={"continue_final_message": None, "function_call": None},
    )
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    done = client.completions.create(model="m", prompt="Hi", max_tokens=2, echo=nulls, n=nulls)
    assert len(done.choices) == 1 and not done.choices[0].text.startswith("Hi")


def test_a_dumped_response_message_goes_back_into_the_history(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    history = [*CHAT, dumped, {"role": "user", "content": "Another?"}]
    again = client.chat.completions.create(model="m", messages=history, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="function_call is not supported"):
        bad = {**dumped, "function_call": {"name": "f", "arguments": "{}"}}
        client.chat.completions.create(model="m", messages=[*CHAT, bad], max_tokens=2)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"stop": ""}, "stop"),
        ({"temprature": 0.5}, "temprature: unknown field"),
    ],
)
def test_invalid_bodies_are_bad_requests_naming_the_field(client: openai.OpenAI, body, field) -> None:
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, extra_body=body)


def test_tool_schemas_are_checked_when_tool_choice_is_none(client: openai.OpenAI) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters"):
        client.chat.completions.create(
            model="m", messages=CHAT, tools=[broken], tool_choice="none", max_tokens=2
        )


def _history_of_calls_after_text() -> list[dict[str, Any]]:
    """Few-shot turns in which the assistant writes a sentence, then calls the tool: greedy SmolLM2
    follows the pattern."""
    turns: list[dict[str, Any]] = []
    for i, city in enumerate(("London", "Berlin", "Rome", "Madrid")):
        args = json.dumps({"city": city})
        call = {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        turns += [
            {"role": "user", "content": f"What's the weather in {city}?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "20C"},
            {"role": "assistant", "content": f"It is 20C in {city}."},
        ]
    return [*turns, {"role": "user", "content": "What's the weather in Paris?"}]


def test_auto_call_keeps_its_text_and_never_repeats_the_tag(client: openai.OpenAI) -> None:
    history = _history_of_calls_after_text()
    args = {"model": "m", "messages": history, "tools": [WEATHER, TIME], "max_tokens": 40, "temperature": 0}
    plain = client.chat.completions.create(**args)
    msg = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls" and msg.tool_calls, msg
    assert msg.content and TOOL_CALL_TAG not in msg.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    )
    assert streamed == msg.content
    for budget in range(1, plain.usage.completion_tokens):
        cut = client.chat.completions.create(**{**args, "max_tokens": budget})
        text = cut.choices[0].message.content or ""
        assert text.count(TOOL_CALL_TAG[:6]) <= 1, (budget, text)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tool_call_logprobs_cover_every_generated_token(client: openai.OpenAI, choice: str) -> None:
    args: dict[str, Any] = {
        "model": "m",
        "messages": _history_of_calls_after_text(),
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    plain = client.chat.completions.create(**args)
    assert plain.choices[0].message.tool_calls, plain.choices[0].message
    entries = plain.choices[0].logprobs.content
    assert len(entries) == plain.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_logit_bias_through_the_client(client: openai.OpenAI, engine) -> None:
    banana = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = client.completions.create(
        model="m",
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        logit_bias={str(banana): 100},
    )
    assert out.choices[0].text == " banana" * 3
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=2,
        temperature=0,
        logit_bias={str(banana): 100},
    )
    assert chat.choices[0].message.content == " banana" * 2
