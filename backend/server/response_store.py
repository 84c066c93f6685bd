"""ResponseStore: the responses /v1/responses keeps (store true, OpenAI's default) for GET, DELETE
and previous_response_id, in memory: at most max_responses, the least recently used dropped first,
and none past a restart. Promises: a stored response's conversation is what the next request of
its chain continues: the earlier turns' items, this request's input, then this response's output
(instructions are not carried over, as OpenAI's are not)."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .responses_request import FunctionCallItem, Item, MessageItem

MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as the client got it
    conversation: tuple[Item, ...]  # every item has an id (given at put where the client sent none)
    inputs_end: int  # conversation[:inputs_end]: the items the response was generated from


def output_items(output: list[dict[str, Any]]) -> list[Item]:
    """A response's output items as input items of the next turn."""
    items: list[Item] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append(MessageItem(role="assistant", content=text, id=item["id"]))
        elif item["type"] == "function_call":
            items.append(
                FunctionCallItem(
                    type="function_call",
                    call_id=item["call_id"],
                    name=item["name"],
                    arguments=item["arguments"],
                    id=item["id"],
                )
            )
    return items


_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def with_id(item: Item) -> Item:
    """The item, with an id of OpenAI's shape for its type where it has none."""
    if item.id is not None:
        return item
    return item.model_copy(update={"id": _ID_PREFIX[item.type] + uuid.uuid4().hex})


class ResponseStore:
    """Stored responses by id. Used from the server's event loop only (no lock)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._by_id.get(response_id)
        if stored is not None:
            self._by_id.move_to_end(response_id)
        return stored

    def put(self, response: dict[str, Any], earlier: tuple[Item, ...], inputs: list[Item]) -> None:
        """Keep a finished response, its conversation ending with its own output. Input items the
        client sent without an id get one here, so /input_items names each the same every time."""
        before = (*earlier, *map(with_id, inputs))
        conversation = (*before, *output_items(response["output"]))
        self._by_id[response["id"]] = StoredResponse(response, conversation, len(before))
        self._by_id.move_to_end(response["id"])
        while len(self._by_id) > self.max_responses:
            self._by_id.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._by_id.pop(response_id, None) is not None
