"""GET /v1/responses/{id}/input_items through the official openai client on real uvicorn (127.0.0.1,
the session engine): the request's items in OpenAI's shapes, newest first unless asked, stable ids,
cursor pages that walk the whole list, a chain's earlier turns included, and 4xx for what cannot be
listed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_helpers import openai_on_thread
from test_server_responses import WEATHER

GREEDY: dict[str, Any] = {"model": "m", "max_output_tokens": 4, "temperature": 0}
ITEMS: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
]


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    with openai_on_thread(engine) as c:
        yield c


def test_the_request_items_are_listed_newest_first_with_stable_ids(client: openai.OpenAI) -> None:
    made = client.responses.create(input=ITEMS, tools=[WEATHER], **GREEDY)
    newest_first = client.responses.input_items.list(made.id)
    assert [i.type for i in newest_first.data] == [
        "function_call_output",
        "function_call",
        "message",
        "message",
    ]
    listed = client.responses.input_items.list(made.id, order="asc")
    assert [i.id for i in listed.data] == [i.id for i in reversed(newest_first.data)]
    assert len({i.id for i in listed.data}) == 4 and not listed.has_more
    user, answer, call, output = (i.model_dump(exclude_none=True) for i in listed.data)
    assert user["id"].startswith("msg_") and user["role"] == "user"
    assert user["content"] == [{"type": "input_text", "text": ITEMS[0]["content"]}]
    assert answer["content"] == [{"type": "output_text", "text": "Let me look.", "annotations": []}]
    assert (call["call_id"], call["name"], call["arguments"]) == (
        "call_1",
        "get_weather",
        ITEMS[2]["arguments"],
    )
    assert (output["call_id"], output["output"], output["status"]) == ("call_1", "Sunny, 21 C", "completed")


def test_pages_of_one_walk_the_whole_list(client: openai.OpenAI) -> None:
    made = client.responses.create(input=ITEMS, tools=[WEATHER], **GREEDY)
    first = client.responses.input_items.list(made.id, order="asc", limit=1)
    assert len(first.data) == 1 and first.has_more
    walked = [item.id for item in client.responses.input_items.list(made.id, order="asc", limit=1)]
    whole = [item.id for item in client.responses.input_items.list(made.id, order="asc").data]
    assert walked == whole and walked[0] == first.data[0].id
    last = client.responses.input_items.list(made.id, order="asc", after=whole[-2])
    assert [i.id for i in last.data] == whole[-1:] and not last.has_more


def test_a_chain_lists_its_earlier_turns_then_its_input(client: openai.OpenAI) -> None:
    first = client.responses.create(input="Name a color.", **GREEDY)
    second = client.responses.create(input="Name another.", previous_response_id=first.id, **GREEDY)
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    first_items = client.responses.input_items.list(first.id, order="asc").data
    assert items[0].id == first_items[0].id  # the same item, the same id, in every list it is in
    assert items[1].id == first.output[0].id
    assert items[2].content[0].text == "Name another."  # type: ignore[union-attr]


def test_what_cannot_be_listed_is_a_4xx_with_the_reason(client: openai.OpenAI) -> None:
    made = client.responses.create(input="Name a color.", **GREEDY)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.input_items.list("resp_missing")
    unstored = client.responses.create(input="Name a color.", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.input_items.list(unstored.id)
    with pytest.raises(openai.BadRequestError, match="no input item with id 'msg_x'"):
        client.responses.input_items.list(made.id, after="msg_x")
    url = f"{client.base_url}responses/{made.id}/input_items"
    for query, reason in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order")):
        bad = httpx.get(f"{url}?{query}", timeout=30)
        assert bad.status_code == 400 and reason in bad.text, (query, bad.text)
    with pytest.raises(openai.BadRequestError, match="include"):
        client.responses.input_items.list(made.id, include=["message.input_image.image_url"])
    included = httpx.get(f"{url}?include=message.input_image.image_url", timeout=30)
    assert included.status_code == 400 and "include" in included.text
