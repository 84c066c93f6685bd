"""GET /v1/responses/{id}/input_items: the items a stored response was generated from (the earlier
turns of its chain, then its own request's input), in OpenAI's item shapes and its cursor page
(`after`, `limit` 1-100, `order` desc by default). Promises: each item keeps one id across calls;
an `after` that names no item of the list is a 400, not an empty page."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import HTTPException

from .response_store import StoredResponse
from .responses_request import FunctionCallItem, Item, MessageItem


def item_shape(item: Item) -> dict[str, Any]:
    """One conversation item as OpenAI lists it: input messages with input_text parts, assistant
    messages with output_text parts, function calls and their outputs as sent."""
    if isinstance(item, MessageItem):
        parts = [item.content] if isinstance(item.content, str) else [p.text for p in item.content]
        if item.role == "assistant":
            content = [{"type": "output_text", "text": t, "annotations": []} for t in parts]
        else:
            content = [{"type": "input_text", "text": t} for t in parts]
        return {
            "id": item.id,
            "type": "message",
            "role": item.role,
            "status": "completed",
            "content": content,
        }
    shape = item.model_dump(exclude_none=True)
    if not isinstance(item, FunctionCallItem) and not isinstance(item.output, str):
        shape["output"] = [{"type": "input_text", "text": p.text} for p in item.output]
    return {**shape, "status": item.status or "completed"}


def input_items_page(
    stored: StoredResponse, after: str | None, limit: int, order: Literal["asc", "desc"]
) -> dict[str, Any]:
    """One page of the response's input items, in `order`, starting after the item `after`."""
    items = [item_shape(i) for i in stored.conversation[: stored.inputs_end]]
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise HTTPException(400, f"after: no input item with id {after!r} in this response")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }
