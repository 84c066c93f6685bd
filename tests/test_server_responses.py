"""/v1/responses through the official openai client on real uvicorn (127.0.0.1, the session
engine). References: the same conversation on /v1/chat/completions (greedy text and token
counts), the client's own stream accumulator (the events must rebuild the whole answer),
jsonschema for text.format and tool arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from server_helpers import openai_on_thread

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": WEATHER_PARAMS,
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    with openai_on_thread(engine) as c:
        yield c


def test_a_text_answer_is_the_chat_answer(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="m", instructions="Answer briefly.", input="Name a color.", max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a color."},
        ],
        max_tokens=8,
        temperature=0,
    )
    choice = chat.choices[0]
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == choice.message.content
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if choice.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


@pytest.mark.parametrize("max_output_tokens", [16, 4])
def test_the_event_stream_rebuilds_the_whole_answer(client: openai.OpenAI, max_output_tokens: int) -> None:
    ask: dict[str, Any] = {
        "model": "m",
        "instructions": "Answer briefly.",
        "input": "Name a color.",
        "max_output_tokens": max_output_tokens,
        "temperature": 0,
    }
    whole = client.responses.create(**ask)
    assert whole.status == ("completed" if max_output_tokens == 16 else "incomplete")
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert (
        kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert deltas == last.output_text == whole.output_text and whole.output_text
    assert last.usage.output_tokens == whole.usage.output_tokens
    assert last.output[0].status == whole.output[0].status == whole.status  # the message ends as the answer
    if whole.status == "completed":  # the client's own accumulator over the events
        assert stream.get_final_response().output_text == whole.output_text


def test_text_format_json_schema_constrains_the_answer(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(
        model="m", input="Invent a person.", text={"format": fmt}, max_output_tokens=48, temperature=0
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_and_its_output_go_round(client: openai.OpenAI, stream: bool) -> None:
    ask: dict[str, Any] = {
        "model": "m",
        "input": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_output_tokens": 40,
        "temperature": 0,
    }
    if stream:
        with client.responses.stream(**ask) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert "response.function_call_arguments.done" in kinds
    else:
        r = client.responses.create(**ask)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    back = [*ask["input"], *(item.model_dump(exclude_none=True) for item in r.output)]
    back += [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls]
    answer = client.responses.create(
        model="m", input=back, tools=[WEATHER], max_output_tokens=6, temperature=0
    )
    assert answer.output[0].type == "message" and answer.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize(
    "extra,reason",
    [
        ({"previous_response_id": "resp_1"}, "Previous response with id 'resp_1' not found"),
        ({"include": ["message.output_text.logprobs"]}, "is not supported"),
        ({"truncation": "auto"}, "truncation"),
        (
            {"background": True},
            r"background responses are not supported: each response is answered within its",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "unknown tool"),
        ({"frequency_penaltyy": 1}, "frequency_penaltyy"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "Sunny"}]},
            r"input\.0\.call_id: No tool call found for function call output with call_id 'call_9'",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            r"text\.format: .*needs json_schema\.schema",
        ),
    ],
)
def test_what_cannot_be_done_is_a_400_with_the_reason(
    client: openai.OpenAI, extra: dict[str, Any], reason: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=reason):
        client.responses.create(model="m", input="Hi", max_output_tokens=2, extra_body=extra)


def test_explicit_nulls_mean_the_defaults(client: openai.OpenAI) -> None:
    nulls: Any = None
    r = client.responses.create(
        model="m", input="Hi", max_output_tokens=2, stream=nulls, tools=nulls, temperature=nulls, text=nulls
    )
    assert r.object == "response" and r.usage.output_tokens <= 2


def test_a_stream_that_cannot_start_is_a_400_not_an_event(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(("}}
    with pytest.raises(openai.BadRequestError, match="pattern"):
        client.responses.create(model="m", input="Hi", text={"format": fmt}, max_output_tokens=4, stream=True)


def test_text_then_a_call_sent_back_is_one_assistant_turn_as_in_chat(client: openai.OpenAI) -> None:
    """An answer's message and function_call items are one turn the model wrote (text, then the
    call): sent back, the prompt is chat's with one assistant message holding both."""
    user = {"role": "user", "content": "What is the weather in Paris?"}
    args = '{"city": "Paris"}'
    items: list[Any] = [
        user,
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    r = client.responses.create(model="m", input=items, tools=[WEATHER], max_output_tokens=6, temperature=0)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    chat = client.chat.completions.create(
        model="m",
        messages=[
            user,  # type: ignore[list-item]
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],  # type: ignore[list-item]
        max_tokens=6,
        temperature=0,
    )
    assert chat.usage is not None and r.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
