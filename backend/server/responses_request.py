"""The body of /v1/responses (OpenAI's Responses API) and its translation to a chat request:
the earlier turns of a previous_response_id chain, then the input items (messages, function calls
and their outputs, an earlier response's output sent back), with the instructions first, become
chat messages; text.format the response_format, function tools the chat tools; SGLang's sampling
extras (as sglang-router sends them) pass through. What this server cannot do (background,
include, reasoning) is refused with the reason; a chat field's validation error names this
request's field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .protocol import ChatCompletionRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ContentPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier response's output_text, sent back
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False  # null: the default, as the openai client sends an explicit None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop turns to fit) is not done
    store: bool | None = None  # None: stored, as OpenAI's default
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    service_tier: str | None = None  # accepted, no effect (as on chat)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # SGLang's extras; sglang-router sends each of them, at its neutral value by default
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None  # scheduling order only: requests are served first come, first served

    @model_validator(mode="after")
    def _unsupported(self) -> ResponsesRequest:
        if self.include:
            raise ValueError(f"include {self.include} is not supported")
        if self.reasoning:
            raise ValueError("reasoning is not supported (no reasoning models)")
        if self.background:
            raise ValueError(
                "background responses are not supported: each response is answered within its request"
            )
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self

    def items(self) -> list[Item]:
        """The input as items (a string input is one user message)."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def chat_request(self, earlier: Sequence[Item] = ()) -> ChatCompletionRequest:
        """The same request as /v1/chat/completions takes it, after the earlier turns of its chain."""
        _check_call_ids(earlier, self.items())
        body: dict[str, Any] = {
            "model": self.model,
            "messages": _messages(self.instructions, [*earlier, *self.items()]),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "stream": bool(self.stream),
            "user": self.user,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"})} for t in self.tools
            ]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
            schema["description"] = fmt.description
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            req: ChatCompletionRequest = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None}
            )
        except ValidationError as exc:  # the 400 names this request's fields, not chat's
            raise RequestValidationError(
                [{**e, "loc": _responses_loc(e["loc"])} for e in exc.errors()]
            ) from exc
        req.check_supported()
        return req


_FIELD = {
    "messages": ("input",),
    "max_completion_tokens": ("max_output_tokens",),
    "response_format": ("text", "format"),
}


def _responses_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A chat field's error location as this request names it."""
    if not loc:
        return loc
    head = _FIELD.get(str(loc[0]), (loc[0],))
    rest = [part for part in loc[1:] if not (loc[0] == "tools" and part == "function")]
    return (*head, *rest)


def _check_call_ids(earlier: Sequence[Item], items: list[Item]) -> None:
    """Each function_call_output answers a function_call made before it in the conversation, as
    OpenAI requires: an output for no call would reach the model as a tool turn nothing asked for."""
    called = {item.call_id for item in earlier if isinstance(item, FunctionCallItem)}
    for k, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
            msg = f"No tool call found for function call output with call_id {item.call_id!r}."
            error = {"type": "value_error", "loc": ("input", k, "call_id"), "msg": msg, "input": item.call_id}
            raise RequestValidationError([error])


def _messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Chat messages: the instructions as the system message, then each item; a function call
    joins the assistant turn before it (its text and earlier calls), since a response's message
    and calls are one turn the model wrote, as chat's assistant message with tool_calls is."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            text = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return out
