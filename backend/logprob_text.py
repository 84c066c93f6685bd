"""The text of each token in a result's logprob lists, for callers that ask for it
(return_text_in_logprobs): the third slot of every (logprob, token_id, text) entry, decoded one
token at a time as SGLang does. Promises: the meta dict given is not changed; lists stay in order."""

from __future__ import annotations

from typing import Any, Protocol

LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")
TOP_LISTS = ("input_top_logprobs", "output_top_logprobs")
OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs")
# SGLang's running count of output logprob entries, in every streamed meta: a chunk whose lists
# hold only its own entries (the Engine's streams) starts at LENGTH - len(list).
LENGTH_KEY = "output_token_logprobs_length"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def add_logprob_text(meta: dict[str, Any], tokenizer: Decoder) -> dict[str, Any]:
    """A copy of meta with each logprob entry's third slot the token's text."""

    def fill(entry: Any) -> Any:
        lp, tid = entry[0], entry[1]
        return [lp, tid, tokenizer.decode([tid])]

    out = dict(meta)
    for key in LOGPROB_LISTS:
        if out.get(key) is not None:
            out[key] = [fill(e) for e in out[key]]
    for key in TOP_LISTS:
        if out.get(key) is not None:
            out[key] = [None if row is None else [fill(e) for e in row] for row in out[key]]
    return out


def with_logprob_text(meta: Any, tokenizer: Decoder | None, wanted: bool) -> Any:
    """meta with its tokens' texts where wanted and there is a tokenizer to decode them (a text
    backend's entries carry their text already); otherwise meta as it is."""
    return (
        add_logprob_text(meta, tokenizer)
        if wanted and tokenizer is not None and isinstance(meta, dict)
        else meta
    )
