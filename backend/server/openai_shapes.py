"""Response pieces shared by the OpenAI completion and chat routes: finish reasons, per-choice
sampling params and request ids, logprob shapes, the usage block and the grammar report. Promises: shapes follow the
OpenAI API reference, and choice j of n > 1 with a seed samples with seed + j."""

from __future__ import annotations

import uuid
from typing import Any, cast


def finish_reason(meta: dict[str, Any]) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return str(fr.get("type")) if isinstance(fr, dict) else str(fr)


GRAMMAR_KEYS = (
    "grammar_dropped_keywords",
    "grammar_checked_keywords",
    "json_schema_valid",
    "json_schema_error",
)


def grammar_report(meta: dict[str, Any]) -> dict[str, Any] | None:
    """What a finished constrained choice reports beyond OpenAI's fields (keywords dropped or held
    by value checks, whether the output validates), as the choice's `radixlm` entry; None if none."""
    report = {k: meta[k] for k in GRAMMAR_KEYS if k in meta}
    return report or None


def sample_params(base: dict[str, Any], j: int, n: int) -> dict[str, Any]:
    sp = dict(base)
    if n > 1 and "seed" in sp:
        sp["seed"] = sp["seed"] + j
    return sp


def choice_rid(req_rid: str | None, k: int, total: int) -> str:
    if req_rid is None:
        return uuid.uuid4().hex
    return req_rid if total == 1 else f"{req_rid}-{k}"


# ---------------------------------------------------------------- logprob shapes


class Tok:
    """Token text and the OpenAI logprob shapes (chat entries, completion logprobs) of token ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, tid: int) -> str:
        return cast(str, self.tokenizer.decode([tid]))

    def chat_entries(self, meta: dict[str, Any]) -> list[dict[str, Any]]:
        lps = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(lps)
        return [
            {**self._entry(e), "top_logprobs": [self._entry(t) for t in (top or [])]}
            for e, top in zip(lps, tops)
        ]

    def _entry(self, e: Any) -> dict[str, Any]:
        tok = self.text(e[1])
        return {"token": tok, "logprob": e[0], "bytes": list(tok.encode("utf-8"))}

    def _completion_top(self, entry: Any, token: str, row: Any) -> dict[str, float] | None:
        """One position's top_logprobs as OpenAI's completions API gives them: the most likely
        tokens, and always the chosen one (so up to logprobs + 1 entries); None where the position
        has no logprob (a prompt's first token)."""
        if entry[0] is None:
            return None
        top = {self.text(t[1]): t[0] for t in row or []}
        top.setdefault(token, entry[0])
        return top

    def completion_logprobs(self, entries: list[Any], tops: list[Any], offset: int) -> dict[str, Any]:
        tokens = [self.text(e[1]) for e in entries]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        top_dicts = [self._completion_top(e, tok, row) for e, tok, row in zip(entries, tokens, tops)]
        return {
            "tokens": tokens,
            "token_logprobs": [e[0] for e in entries],
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
