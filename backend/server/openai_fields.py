"""OpenAI request fields beyond sampling, each with a stated fate: honoured (guided_json/_regex/
_grammar/_choice and structured_outputs become the request's constraint; chat_template_kwargs is
in ChatCompletionRequest), informational (accepted, no effect on the output; `user` is logged), or
refused with the reason. Unknown fields are a 400 naming the field."""

from __future__ import annotations

import functools
import re
import types
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Accepted and without effect on the output (bookkeeping or options of features absent here).
INFORMATIONAL = (
    "metadata",
    "store",
    "service_tier",
    "reasoning_effort",
    "separate_reasoning",
    "prompt_cache_key",
    "safety_identifier",
    "user",
)
# Known fields refused with a reason instead of a bare 'unknown field'.
REFUSED = {
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the legacy `functions` field is not supported; use `tools`",
    "function_call": "the legacy `function_call` field is not supported; use `tool_choice`",
    "guided_decoding_backend": "the constraint backend is chosen by the server",
    "guided_whitespace_pattern": "custom JSON whitespace patterns are not supported",
}


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json / regex / choice / grammar / json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ClientFields(BaseModel):
    """Mixin of the OpenAI request models (completions and chat)."""

    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    separate_reasoning: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_known_unsupported(cls, data: Any) -> Any:
        """Also: a null for a field that cannot be None means 'not given' (the OpenAI spec marks
        such fields nullable, and the official client sends null for a None argument)."""
        if isinstance(data, dict):
            for key, value in data.items():
                if key in REFUSED and value is not None:
                    raise ValueError(f"{key}: {REFUSED[key]}")
            dropped = _not_nullable(cls) | REFUSED.keys()
            return {k: v for k, v in data.items() if v is not None or k not in dropped}
        return data

    def guided_constraints(self) -> dict[str, Any]:
        """The constraint these fields ask for, as engine sampling params ({} when none)."""
        found: list[tuple[str, Any]] = []
        if self.guided_json is not None:
            found.append(("json_schema", self.guided_json))
        if self.guided_regex is not None:
            found.append(("regex", self.guided_regex))
        if self.guided_grammar is not None:
            found.append(("ebnf", self.guided_grammar))
        if self.guided_choice is not None:
            found.append(("regex", choice_regex(self.guided_choice)))
        so = self.structured_outputs
        if so is not None:
            for key, value in (("json_schema", so.json_), ("regex", so.regex), ("ebnf", so.grammar)):
                if value is not None:
                    found.append((key, value))
            if so.choice is not None:
                found.append(("regex", choice_regex(so.choice)))
            if so.json_object:
                found.append(("json_schema", {"type": "object"}))
        if len(found) > 1:
            raise ValueError("give one constraint: guided_* and structured_outputs fields exclude each other")
        return dict(found)


def choice_regex(choices: list[str]) -> str:
    if not choices:
        raise ValueError("a choice constraint needs at least one choice")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


@functools.cache
def _not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """Names of the model's fields that have a default and do not take None."""
    return frozenset(
        f.alias or name
        for name, f in model.model_fields.items()
        if not f.is_required() and f.annotation is not Any and types.NoneType not in get_args(f.annotation)
    )


class ResponseMessageFields(BaseModel):
    """Fields of a response's message that a client may send back in `messages` (the official
    client's `message.model_dump()` has them): the text ones have no effect on the prompt."""

    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _refuse_set_audio_or_function_call(self) -> ResponseMessageFields:
        if self.audio is not None:
            raise ValueError("a message's audio is not supported")
        if self.function_call is not None:
            raise ValueError("a message's legacy function_call is not supported; use tool_calls")
        return self
