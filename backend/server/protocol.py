"""Request/response shapes of the HTTP server (native SGLang-style API and OpenAI API).
Every request model forbids unknown fields, so a typo is a 400 with the field's name, never
silently ignored. Sampling fields are built from the one definition (backend/sampling_params.py):
its keys, wire types and value checks; the engine does the checks across keys."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from ..sampling_params import CONSTRAINT_KEYS, FRONTEND_NAMES, SAMPLING_KEYS, check_values, wire_fields
from .openai_fields import ClientFields, ResponseMessageFields
from .sglang_fields import MAX_TOP_LOGPROBS, GenerateFields, SGLangOpenAIFields

# Hard ceiling on prompts x n per request, checked before any fan-out: otherwise a huge `n` would
# build that many sequences before the server's configured limit is checked, and hang the server.
MAX_SEQUENCES = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- native API


def _optional(keys: tuple[str, ...], names: dict[str, str] | None = None) -> dict[str, Any]:
    """pydantic fields for sampling keys, every one optional (None: not set), typed as the one
    definition's wire types and renamed by `names` (OpenAI's max_tokens, ...)."""
    wire = wire_fields()
    return {(names or {}).get(k, k): (wire[k][0] | None, None) for k in keys}


class _CheckedSampling(_Strict):
    """Runs the one definition's value check on each sampling field a client set, so an error
    names the field as the client spelled it."""

    @field_validator("*", mode="after")
    @classmethod
    def _value(cls, v: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        key = _ENGINE_NAMES.get(name, name)
        if v is not None and key in SAMPLING_KEYS:
            check_values({key: v}, {key: name})
        return v


_ENGINE_NAMES = {v: k for k, v in FRONTEND_NAMES.items()}


_NativeSampling = create_model("_NativeSampling", __base__=_CheckedSampling, **_optional(SAMPLING_KEYS))


class SamplingParams(_NativeSampling):  # type: ignore[misc,valid-type]
    """The engine's sampling parameters (SGLang names), as defined in backend/sampling_params.py."""

    def to_engine(self) -> dict[str, Any]:
        """Only the fields the client set, without `n` (the server fans out samples itself)."""
        out: dict[str, Any] = self.model_dump(exclude_none=True)
        out.pop("n", None)
        return out


class GenerateRequest(GenerateFields):
    """POST /generate: one prompt or a batch, as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("`text` is an empty batch: give at least one prompt")
        n_prompts = (
            len(self.text)
            if isinstance(self.text, list)
            else (len(self.input_ids) if self.is_batch and self.input_ids is not None else 1)
        )
        params = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]
        _check_fanout(n_prompts * max((sp.n or 1) if sp else 1 for sp in params) if params else n_prompts)
        return self

    def prompts(self) -> list[dict[str, Any]]:
        """The batch as a list of {'text': ...} / {'input_ids': ...} items."""
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else self.text
            return [{"text": t} for t in texts]
        ids = self.input_ids or []
        if ids and isinstance(ids[0], list):
            return [{"input_ids": list(x)} for x in ids]
        return [{"input_ids": list(ids)}]

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return not isinstance(self.text, str)
        ids = self.input_ids
        return ids is not None and len(ids) > 0 and isinstance(ids[0], list)


def _check_fanout(n_sequences: int) -> None:
    if n_sequences > MAX_SEQUENCES:
        raise ValueError(f"request asks for {n_sequences} sequences (prompts x n); at most {MAX_SEQUENCES}")


class AbortRequest(_Strict):
    """SGLang's body: one request id, or abort_all for every request in flight."""

    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _names_what_to_abort(self) -> AbortRequest:
        if not self.rid and not self.abort_all:
            raise ValueError("give rid or abort_all: true")
        return self


# ---------------------------------------------------------------- OpenAI API


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # every chunk with its choice's usage so far


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format type 'json_schema' needs json_schema.schema")
        return self


# Sampling keys under their own names; max tokens and n have OpenAI fields with per-endpoint defaults.
_OPENAI_KEYS = tuple(k for k in SAMPLING_KEYS if k not in ("max_new_tokens", "n"))


class _OpenAIChecked(ClientFields, SGLangOpenAIFields, _CheckedSampling):
    pass


_OpenAISampling = create_model(
    "_OpenAISampling", __base__=_OpenAIChecked, **_optional(_OPENAI_KEYS, FRONTEND_NAMES)
)


class _SamplingExtras(_OpenAISampling):  # type: ignore[misc,valid-type]
    """OpenAI fields shared by completions and chat; every sampling key of the one definition
    (SGLang's extras such as top_k, regex, json_schema included) under its OpenAI name."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_SEQUENCES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    rid: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingExtras:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """The engine sampling params for one sample (constraint from response_format too)."""
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        for key in _OPENAI_KEYS:
            value = getattr(self, FRONTEND_NAMES.get(key, key))
            if value is not None:
                sp[key] = value
        sp["seed"] = self.seed_value(self.seed)
        guided = self.guided_constraints()
        if guided and any(k in sp for k in CONSTRAINT_KEYS):
            raise ValueError("guided_*/structured_outputs cannot be combined with regex/json_schema/ebnf")
        sp.update(guided)
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if any(k in sp for k in CONSTRAINT_KEYS):
                raise ValueError("response_format cannot be combined with regex/json_schema/ebnf")
            js = fmt.json_schema if fmt.type == "json_schema" else None
            sp["json_schema"] = js.schema_ if js is not None else {"type": "object"}
            if js is not None and js.strict is False:
                sp["json_schema_strict"] = False
        return {k: v for k, v in sp.items() if v is not None}


class CompletionRequest(_SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        batch = isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        _check_fanout((len(self.prompt) if batch else 1) * self.n)
        return self

    def prompts(self) -> list[dict[str, Any]]:
        p = self.prompt
        if isinstance(p, str):
            return [{"text": p}]
        if isinstance(p[0], str):
            return [{"text": t} for t in p]
        if isinstance(p[0], int):
            return [{"input_ids": list(p)}]
        return [{"input_ids": list(x)} for x in p]


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(ResponseMessageFields, _Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # no empty reply, as in OpenAI's and vLLM's
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (e.g. enable_thinking)
    # SGLang's: the last (assistant) message is continued instead of answered with a new turn
    continue_final_message: bool = False
    stream_reasoning: bool | None = None  # accepted, no effect (see sglang_fields.INFORMATIONAL)

    @model_validator(mode="after")
    def _tool_choice_valid(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names unknown tool {choice.function.name!r}")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ProgramRunRequest(_Strict):
    """POST /programs/{name}: the program's arguments and default sampling options."""

    args: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    max_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None

    def sampling_options(self, max_new_tokens_limit: int | None) -> dict[str, Any]:
        if (
            self.max_new_tokens is not None
            and max_new_tokens_limit is not None
            and self.max_new_tokens > max_new_tokens_limit
        ):
            raise ValueError(f"max_new_tokens {self.max_new_tokens} exceeds the limit {max_new_tokens_limit}")
        return self.model_dump(exclude_none=True, exclude={"args", "stream"})


# ---------------------------------------------------------------- response helpers


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# One vocabulary for error.type, OpenAI's; a route's more specific word is kept only if it is one of these.
ERROR_TYPES = (
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
)


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(
    message: str, status: int, err_type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI-style error object (the openai client reads error.message); `type` is always one
    of ERROR_TYPES, derived from the status unless err_type is one of them."""
    kind = err_type if err_type in ERROR_TYPES else error_type(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
