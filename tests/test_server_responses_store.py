"""Stored /v1/responses through the official openai client on real uvicorn (127.0.0.1, the session
engine): retrieve and delete, store false, previous_response_id chains (text turns, a function call
and its output, no instructions carried over) against the same conversation sent whole to
/v1/chat/completions, a streamed response stored, the store's LRU bound, and the body sglang-router
forwards (its SGLang sampling extras) accepted and honoured."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_helpers import openai_on_thread
from test_server_responses import WEATHER, WEATHER_PARAMS

from radixlm.backend.server.response_store import ResponseStore

GREEDY: dict[str, Any] = {"model": "m", "max_output_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    with openai_on_thread(engine) as c:
        yield c


def chat_reference(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, **kw)


def test_a_stored_response_is_retrieved_then_deleted(client: openai.OpenAI) -> None:
    made = client.responses.create(input="Name a color.", **GREEDY)
    assert made.store is True
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.cancel(made.id)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    made = client.responses.create(input="Name a color.", store=False, **GREEDY)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(input="Another.", previous_response_id=made.id, **GREEDY)


def test_a_chain_continues_the_conversation_as_chat_would(client: openai.OpenAI) -> None:
    first = client.responses.create(instructions="Answer briefly.", input="Name a color.", **GREEDY)
    second = client.responses.create(
        instructions="Answer briefly.", input="Name another.", previous_response_id=first.id, **GREEDY
    )
    third = client.responses.create(input="And a third?", previous_response_id=second.id, **GREEDY)
    turns = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name another."},
    ]
    ref = chat_reference(client, [{"role": "system", "content": "Answer briefly."}, *turns])
    assert second.previous_response_id == first.id
    assert second.output_text == ref.choices[0].message.content
    assert second.usage.input_tokens == ref.usage.prompt_tokens
    # the third request sets no instructions: the first two turns' are not carried over
    turns += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And a third?"},
    ]
    ref = chat_reference(client, turns)
    assert third.output_text == ref.choices[0].message.content
    assert third.usage.input_tokens == ref.usage.prompt_tokens


def test_a_function_call_is_answered_through_the_chain(client: openai.OpenAI) -> None:
    ask = {"model": "m", "tools": [WEATHER], "max_output_tokens": 40, "temperature": 0}
    asked = client.responses.create(input="What is the weather in Paris?", tool_choice="required", **ask)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert calls and json.loads(calls[0].arguments).keys() == WEATHER_PARAMS["properties"].keys()
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls]
    chained = client.responses.create(
        input=outputs, previous_response_id=asked.id, **{**ask, "max_output_tokens": 6}
    )
    whole = [
        {"role": "user", "content": "What is the weather in Paris?"},
        *(item.model_dump(exclude_none=True) for item in asked.output),
        *outputs,
    ]
    sent_whole = client.responses.create(input=whole, **{**ask, "max_output_tokens": 6})
    assert chained.output_text == sent_whole.output_text
    assert chained.usage.input_tokens == sent_whole.usage.input_tokens


def test_a_streamed_response_is_stored_when_it_ends(client: openai.OpenAI) -> None:
    events = list(client.responses.create(input="Name a color.", stream=True, **GREEDY))
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    got = client.responses.retrieve(final.id)
    assert got.output_text == final.output_text and got.usage == final.usage


def test_the_body_sglang_router_forwards_is_accepted_and_its_extras_honoured(client: openai.OpenAI) -> None:
    """sglang-router re-serializes a Responses request with its defaults and SGLang's extras."""
    routed = {
        "input": "Name a color.",
        "max_output_tokens": 8,
        "model": "m",
        "store": True,
        "stream": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "priority": 0,
        "top_k": 1,  # the router's default is -1; 1 makes sampling greedy, which is checkable
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    resp = httpx.post(f"{client.base_url}responses", json=routed, timeout=60)
    assert resp.status_code == 200, resp.text
    greedy = client.responses.create(input="Name a color.", **GREEDY)
    assert resp.json()["output"][0]["content"][0]["text"] == greedy.output_text
    bad = httpx.post(f"{client.base_url}responses", json={**routed, "top_k": -2}, timeout=60)
    assert bad.status_code == 400 and "top_k" in bad.text


def test_the_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2)

    def response(rid: str) -> dict[str, Any]:
        return {"id": rid, "output": [{"type": "message", "id": "m", "content": [{"text": rid}]}]}

    store.put(response("a"), (), [])
    store.put(response("b"), (), [])
    assert store.get("a") is not None  # a is now the most recent
    store.put(response("c"), (), [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert [item.text() for item in store.get("c").conversation] == ["c"]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="at least 1"):
        ResponseStore(0)
