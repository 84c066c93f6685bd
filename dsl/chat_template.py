"""Role text for programs, taken from the tokenizer's own Jinja chat template: the text a
role adds is the difference between rendering the messages with and without it, so a
program's text equals `apply_chat_template(messages)` for the messages it built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Messages = list[dict[str, Any]]
_SENTINEL = "\x00RADIXLM_CONTENT\x00"


class ChatTemplate:
    """Renders role prefixes/suffixes from a `render(messages) -> str` function."""

    def __init__(self, render: Callable[[Messages], str], name: str = "jinja") -> None:
        self._render = render
        self.name = name

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return PlainChatTemplate()

        def render(messages: Messages) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

        return cls(render, name="tokenizer")

    def _safe_render(self, messages: Messages) -> str:
        if not messages:
            try:
                return self._render([])
            except Exception:
                return ""
        return self._render(messages)

    def prefix_and_suffix(self, role: str, messages: Messages) -> tuple[str, str]:
        """Text before and after a new `role` message appended after `messages`."""
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"unknown role {role!r}; expected system, user or assistant")
        base = self._safe_render(messages)
        try:
            full = self._render([*messages, {"role": role, "content": _SENTINEL}])
        except Exception as e:  # jinja raise_exception, e.g. roles must alternate
            raise ValueError(f"chat template rejects a {role!r} message here: {e}") from e
        if not full.startswith(base) or _SENTINEL not in full:
            raise ValueError(
                f"chat template ({self.name}) is not incremental: rendering one more {role!r} message "
                "changes the text of earlier messages"
            )
        cut = full.index(_SENTINEL)
        return full[len(base) : cut], full[cut + len(_SENTINEL) :]


class PlainChatTemplate(ChatTemplate):
    """For backends without a tokenizer template: 'Role: content' lines."""

    def __init__(self) -> None:
        super().__init__(self._plain, name="plain")

    @staticmethod
    def _plain(messages: Messages) -> str:
        return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
