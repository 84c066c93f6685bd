"""Chat messages → prompt token ids, and OpenAI tool calling on any chat model. Tools are
described in a system message and called as `<tool_call>` + JSON; the JSON is always generated
under a JSON schema built from the tools' own parameter schemas, so arguments always parse."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from radixlm.grammars.json_schema import check_schema

from .info import render_chat
from .protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool

TOOL_CALL_TAG = "<tool_call>"
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass
class ToolPlan:
    """How a chat request uses tools: the mode and the schema its call JSON must follow."""

    mode: ToolMode
    tools: list[Tool]
    parallel: bool
    named: str | None = None

    @property
    def strict(self) -> bool:
        """Call arguments are always grammar-constrained to the schema; a tool with strict=false
        lets the grammar drop (and name) schema keywords it cannot enforce instead of refusing."""
        return all(t.function.strict is not False for t in self.tools)

    def call_schema(self) -> dict[str, Any]:
        """Schema of what follows the tag (auto) or of the whole reply (required/named)."""
        if self.mode == "named":
            return _parameters(self._tool(self.named))
        one = [_call_object(t) for t in self.tools]
        single: dict[str, Any] = one[0] if len(one) == 1 else {"anyOf": one}
        if self.parallel:
            return {"type": "array", "items": single, "minItems": 1}
        return single

    def parse(self, text: str) -> list[dict[str, Any]]:
        """Constrained JSON → OpenAI tool_calls; ValueError if it is not what the schema says."""
        value = json.loads(text)
        if self.mode == "named":
            calls = [{"name": self.named, "arguments": value}]
        else:
            calls = value if isinstance(value, list) else [value]
        names = {t.function.name for t in self.tools}
        out = []
        for call in calls:
            if not isinstance(call, dict) or call.get("name") not in names:
                raise ValueError(f"generated tool call does not name a known tool: {call!r}")
            out.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
                    },
                }
            )
        return out

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.function.name == name)


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    tools = list(req.tools or [])
    choice = req.tool_choice
    for i, tool in enumerate(tools):  # in every mode: auto would meet a broken schema only mid-call
        try:
            check_schema(_parameters(tool))
        except ValueError as e:
            raise ValueError(f"tools[{i}].function.parameters: {e}") from e
    if not tools or choice == "none":
        return ToolPlan("none", [], req.parallel_tool_calls)
    if req.response_format is not None and req.response_format.type != "text":
        raise ValueError("response_format cannot be combined with tools")
    if any(getattr(req, k) is not None for k in ("regex", "json_schema", "ebnf")):
        raise ValueError("regex/json_schema/ebnf cannot be combined with tools")
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", tools, False, named=choice.function.name)
    return ToolPlan("required" if choice == "required" else "auto", tools, req.parallel_tool_calls)


def _parameters(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params else {"type": "object"}


def _call_object(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "arguments": _parameters(tool),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _tools_system_text(plan: ToolPlan) -> str:
    specs = "\n".join(
        json.dumps(
            {
                "name": t.function.name,
                "description": t.function.description or "",
                "parameters": _parameters(t),
            },
            ensure_ascii=False,
        )
        for t in plan.tools
    )
    shape = (
        'a JSON list of objects {"name": <tool name>, "arguments": <arguments object>}'
        if plan.parallel
        else 'a JSON object {"name": <tool name>, "arguments": <arguments object>}'
    )
    if plan.mode == "named":
        how = f"Call the tool {plan.named} now: reply with only its arguments as a JSON object."
    elif plan.mode == "required":
        how = f"You must call a tool now: reply with only {shape}."
    else:
        how = f"To call tools, write {TOOL_CALL_TAG} followed by {shape}; otherwise answer normally."
    return f"You can use these tools:\n<tools>\n{specs}\n</tools>\n{how}"


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """OpenAI messages → plain role/content dicts any chat template accepts."""
    out = []
    for m in messages:
        content = m.text()
        role = "system" if m.role == "developer" else m.role
        if m.role == "assistant" and m.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _loads_or_str(c.function.arguments)}
                for c in m.tool_calls
            ]
            content = (
                (content + "\n" if content else "")
                + TOOL_CALL_TAG
                + json.dumps(calls if len(calls) > 1 else calls[0], ensure_ascii=False)
            )
        elif m.role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    return out


def _loads_or_str(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it."""
    messages = _template_messages(req.messages)
    if plan.mode != "none":
        tool_text = _tools_system_text(plan)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + tool_text}
        else:
            messages.insert(0, {"role": "system", "content": tool_text})
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    text = render_chat(tokenizer, messages, True, req.chat_template_kwargs, req.continue_final_message)
    return list(tokenizer.encode(text, add_special_tokens=False))
