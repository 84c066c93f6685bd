"""/v1/responses, OpenAI's Responses API, on the chat route's machinery (the request's
translation is in responses_request.py): the chat choice comes back as Responses output items (a
message with output_text, then function_call items) with Responses usage and status, whole or as
the Responses event stream. A finished response is stored (unless the request says store: false)
for GET, DELETE, its input_items and the next request's previous_response_id (response_store.py,
response_items.py)."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from pydantic import BaseModel

from .openai_chat import ChatChoice, ChatCtx, ChoiceEvent, choice_events, collect_choice, prepare_chat
from .openai_shapes import Tok
from .protocol import now
from .response_items import input_items_page
from .response_store import ResponseStore, StoredResponse
from .responses_request import Item, ResponsesRequest
from .runner import Runner, Seq
from .streams import sse_response, stream_error, until_disconnect


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _call_item(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    args = fn["arguments"] if arguments is None else arguments
    item_id = "fc_" + call["id"].removeprefix("call_")
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": args,
        "status": status,
    }


def _item_status(choice: ChatChoice) -> str:
    return "incomplete" if choice.finish == "length" and not choice.tool_calls else "completed"


def _status(finish: str | None) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, incomplete_details, error) for a choice's finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish in ("stop", "tool_calls"):
        return "completed", None, None
    return "failed", None, {"code": "server_error", "message": "the request was aborted before it finished"}


class Shape:
    """What every snapshot of one response shares: its id, model, and the request's settings."""

    def __init__(
        self, req: ResponsesRequest, ctx: ChatCtx, model: str, earlier: tuple[Item, ...] = ()
    ) -> None:
        self.req, self.ctx, self.model, self.earlier = req, ctx, model, earlier
        key = uuid.uuid4().hex  # OpenAI's id shapes: resp_..., msg_...
        self.id, self.message_id, self.created = f"resp_{key}", f"msg_{key}", now()

    def response(self, output: list[dict[str, Any]], choice: ChatChoice | None = None) -> dict[str, Any]:
        """The response object: in progress without a choice, else as the choice finished."""
        req = self.req
        status, incomplete, error = ("in_progress", None, None) if choice is None else _status(choice.finish)
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": self.usage(choice) if choice is not None else None,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": [t.model_dump(by_alias=True) for t in req.tools or []],
            "tool_choice": (
                req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice
            )
            or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "metadata": req.metadata or {},
            "store": req.store is not False,
            "previous_response_id": req.previous_response_id,
            "truncation": "disabled",
            "background": False,
            "user": req.user,
        }

    def usage(self, choice: ChatChoice) -> dict[str, Any]:
        prompt = len(self.ctx.prompt_ids)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": choice.cached},
            "output_tokens": choice.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + choice.tokens,
        }

    def output(self, choice: ChatChoice) -> list[dict[str, Any]]:
        """A message with the text (also an empty one, where no call was made), then the calls."""
        calls = choice.tool_calls or []
        head = (
            [_message_item(self.message_id, choice.content, _item_status(choice))]
            if choice.content or not calls
            else []
        )
        return head + [_call_item(c, "completed") for c in calls]


class _Events:
    """One answer's Responses events, numbered, and its output items as they complete."""

    def __init__(self, shape: Shape) -> None:
        self.shape, self.numbers = shape, itertools.count()
        self.choice, self.output = ChatChoice(0), list[dict[str, Any]]()
        self.text_at: int | None = None  # the output index of the open message item

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def take(self, ev: ChoiceEvent) -> list[bytes]:
        """The events for one of the chat choice's events."""
        if ev[0] == "delta":
            out = self._open_text() if self.text_at is None else []
            self.choice.add(ev)
            ids = {"item_id": self.shape.message_id, "output_index": self.text_at, "content_index": 0}
            return [*out, self.event("response.output_text.delta", **ids, delta=ev[1], logprobs=[])]
        out = self._close_text() if ev[0] == "tool_calls" else []  # text before the calls is complete
        self.choice.add(ev)
        if ev[0] == "finish":  # the text item ends as the answer did
            return [*out, *self._close_text()]
        for call in ev[1]:
            out += self._call(call)
        return out

    def end(self) -> tuple[list[bytes], dict[str, Any]]:
        """The last events: an empty message where nothing was written (as the whole answer has),
        then response.completed, .incomplete or .failed with the whole response; and that response."""
        out = [*self._open_text(), *self._close_text()] if not self.output else []
        final = self.shape.response(self.output, self.choice)
        return [*out, self.event(f"response.{final['status']}", response=final)], final

    def _open_text(self) -> list[bytes]:
        self.text_at = at = len(self.output)
        opened = _message_item(self.shape.message_id, "", "in_progress")
        part = opened.pop("content")[0]
        ids = {"item_id": self.shape.message_id, "output_index": at, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=at, item={**opened, "content": []}),
            self.event("response.content_part.added", **ids, part=part),
        ]

    def _close_text(self) -> list[bytes]:
        if self.text_at is None:
            return []
        at, self.text_at, text = self.text_at, None, self.choice.content
        item = _message_item(self.shape.message_id, text, _item_status(self.choice))
        self.output.append(item)
        ids = {"item_id": self.shape.message_id, "output_index": at, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=text, logprobs=[]),
            self.event("response.content_part.done", **ids, part=item["content"][0]),
            self.event("response.output_item.done", output_index=at, item=item),
        ]

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        at, item = len(self.output), _call_item(call, "completed")
        self.output.append(item)
        ids = {"item_id": item["id"], "output_index": at}
        return [
            self.event(
                "response.output_item.added", output_index=at, item=_call_item(call, "in_progress", "")
            ),
            self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done", **ids, arguments=item["arguments"], name=item["name"]
            ),
            self.event("response.output_item.done", output_index=at, item=item),
        ]


async def response_events(
    runner: Runner, shape: Shape, seq: Seq, store: ResponseStore
) -> AsyncGenerator[bytes, None]:
    """The Responses event stream. The first engine event is awaited before response.created,
    so an error in starting the request propagates as the HTTP status (sse_response); the
    response is stored once its last event is written."""
    events = choice_events(runner, shape.ctx, seq, True)
    stream = _Events(shape)
    started = False
    try:
        ev = await anext(events, None)
        started = True
        yield stream.event("response.created", response=shape.response([]))
        yield stream.event("response.in_progress", response=shape.response([]))
        while ev is not None:
            for out in stream.take(ev):
                yield out
            ev = await anext(events, None)
        events_out, final = stream.end()
        for out in events_out:
            yield out
        keep(store, shape, final)
    except Exception as exc:  # noqa: BLE001 - the stream ends with it as an error event
        if not started:
            raise
        status, message = stream_error(exc)
        code = "invalid_request_error" if status == 400 else "server_error"
        yield stream.event("error", code=code, message=message, param=None)
    finally:
        await events.aclose()
        runner.release_all([seq])


def keep(store: ResponseStore, shape: Shape, final: dict[str, Any]) -> None:
    """Store a finished response unless its request said store: false."""
    if shape.req.store is not False:
        store.put(final, shape.earlier, shape.req.items())


def register(app: FastAPI, runner: Runner, tok: Tok, log_user: Callable[[Request, str | None], None]) -> None:
    store = app.state.response_store = ResponseStore()

    def stored(response_id: str) -> StoredResponse:
        found = store.get(response_id)
        if found is None:
            raise HTTPException(404, f"Response with id {response_id!r} not found.")
        return found

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        return stored(response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        request: Request,
        response_id: str,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> Any:
        query = request.query_params  # the openai client sends a list as include[]=...
        include = query.getlist("include") + query.getlist("include[]")
        if include:
            raise HTTPException(
                400, f"include {include} is not supported: input items carry no extra fields here"
            )
        return input_items_page(stored(response_id), after, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Any:
        stored(response_id)
        raise HTTPException(400, "only background responses can be cancelled, and this server runs none")

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        log_user(request, req.user)
        earlier: tuple[Item, ...] = ()
        if req.previous_response_id is not None:
            prev = store.get(req.previous_response_id)
            if prev is None:
                raise HTTPException(400, f"Previous response with id {req.previous_response_id!r} not found.")
            earlier = prev.conversation
        ctx, (seq,) = prepare_chat(runner, tok, req.chat_request(earlier))
        shape = Shape(req, ctx, req.model or app.state.model_name, earlier)
        if req.stream:
            return await sse_response(request, response_events(runner, shape, seq, store))
        try:
            choice = await until_disconnect(request, collect_choice(runner, ctx, seq))
        finally:
            runner.release_all([seq])
        final = shape.response(shape.output(choice), choice)
        keep(store, shape, final)
        return final
