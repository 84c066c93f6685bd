"""Token healing for `select`: which token ids each choice is scored as. A prompt that ends in a
token a choice would merge with ("is" + " " then "Paris", where text tokenizes as "is" + " Paris")
scores every choice from one token back, so each choice meets the model as text would tokenize;
the state then holds the chosen choice's ids the same way."""

from __future__ import annotations

from typing import Protocol


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def select_prompts(codec: Codec, prefix: list[int], choices: list[str]) -> tuple[int, list[list[int]]]:
    """(start, prompts): each choice's full prompt ids, scored from position `start`.

    Without healing, prompt = prefix + encode(choice) and start = len(prefix). When the prefix's
    last token merges into at least one choice, every choice is encoded together with that
    token's text and scored from one position earlier, so all choices are scored on the same
    context (prefix less its last token)."""
    plain = (len(prefix), [prefix + codec.encode(c) for c in choices])
    if len(prefix) < 2:  # the first prompt token has no logprob to score a healed choice with
        return plain
    last = prefix[-1]
    tail = codec.decode([last])
    if not tail or "\ufffd" in tail:  # part of a multi-byte character: its text is not its own
        return plain
    healed = [codec.encode(tail + c) for c in choices]
    if all(ids[:1] == [last] for ids in healed):
        return plain
    if any(codec.decode(ids) != tail + c for ids, c in zip(healed, choices, strict=True)):
        return plain
    return len(prefix) - 1, [prefix[:-1] + ids for ids in healed]


def chosen_prompt(codec: Codec, prefix: list[int], choices: list[str], decision: str) -> list[int]:
    """The state's ids after `select` picked `decision`: its prompt as it was scored."""
    return select_prompts(codec, prefix, choices)[1][choices.index(decision)]
