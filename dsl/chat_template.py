"""Role text for programs, taken from the tokenizer's own Jinja chat template: the text a
role adds is the difference between rendering the messages with and without it, so a
program's text equals `apply_chat_template(messages)` for the messages it built."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

Messages = list[dict[str, Any]]
_SENTINEL = "\x00RADIXLM_CONTENT\x00"
# Role texts kept per template: a batch of programs renders the same roles after the same
# messages (two Jinja renders each, about half a short program's own host time). Bounded in
# entries and in the text a key may hold (long histories are rendered, not kept).
MEMO_ENTRIES = 1024
MEMO_KEY_CHARS = 16384


class ChatTemplate:
    """Renders role prefixes/suffixes from a `render(messages) -> str` function."""

    def __init__(self, render: Callable[[Messages], str], name: str = "jinja", memoize: bool = False) -> None:
        """memoize: render is a pure function of the messages, so role texts may be kept."""
        self._render = render
        self.name = name
        self._memo: dict[Hashable, tuple[str, str]] | None = {} if memoize else None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate:
        """The tokenizer's template; its role texts are memoized unless it reads the clock
        (transformers' strftime_now), when the same messages may render differently."""
        source = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if not source:
            return PlainChatTemplate()

        def render(messages: Messages) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

        return cls(render, name="tokenizer", memoize="strftime" not in str(source))

    def _safe_render(self, messages: Messages) -> str:
        if not messages:
            try:
                return self._render([])
            except Exception:
                return ""
        return self._render(messages)

    def prefix_and_suffix(self, role: str, messages: Messages) -> tuple[str, str]:
        """Text before and after a new `role` message appended after `messages`."""
        memo = self._memo
        key = None if memo is None else _memo_key(role, messages)
        if memo is None or key is None:
            return self._prefix_and_suffix(role, messages)
        out = memo.get(key)
        if out is None:
            out = self._prefix_and_suffix(role, messages)
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            memo[key] = out
        return out

    def _prefix_and_suffix(self, role: str, messages: Messages) -> tuple[str, str]:
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


def _memo_key(role: str, messages: Messages) -> Hashable | None:
    """The role and every message's items, or None when a value is unhashable (content parts)
    or the messages' text is longer than MEMO_KEY_CHARS."""
    if sum(len(v) for m in messages for v in m.values() if isinstance(v, str)) > MEMO_KEY_CHARS:
        return None
    try:
        key = (role, tuple(tuple(sorted(m.items())) for m in messages))
        hash(key)
    except TypeError:
        return None
    return key


class PlainChatTemplate(ChatTemplate):
    """For backends without a tokenizer template: 'Role: content' lines."""

    def __init__(self) -> None:
        super().__init__(self._plain, name="plain")

    @staticmethod
    def _plain(messages: Messages) -> str:
        return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
