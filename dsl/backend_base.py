"""The ProgramBackend interface the interpreter talks to, and TokenBackend: its shared
implementation for backends that take token ids (in-process engine, radixlm HTTP server).
Promise: `select` scores exactly each choice's own tokens after the state's token prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from radixlm.backend.logprob_text import LENGTH_KEY, OUTPUT_LISTS
from radixlm.chat_template import ChatTemplate
from radixlm.choices import ChoicesDecision, ChoicesSamplingMethod, call_method, needs_unconditional
from radixlm.run_cancel import RunCancel
from radixlm.select_healing import select_prompts
from radixlm.tokens import TokenCodec


class ProgramView(Protocol):
    """What a backend reads of the running program; the interpreter's Executor provides it
    (a protocol here, so this module and the interpreter do not import each other)."""

    text_: str
    ids_: list[int]
    messages_: list[dict[str, Any]]
    cur_role: str | None
    cur_role_begin_pos: int
    codec: TokenCodec | None
    cancel: RunCancel | None


_OUT_LOGPROBS = OUTPUT_LISTS


def raise_if_aborted(meta: dict[str, Any]) -> None:
    """A request the engine ended with an abort (KV pool stalled, grammar dead end, shutdown) fails
    its gen with the engine's reason: its text is a fragment, not an answer."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise RuntimeError(f"generation aborted: {reason.get('message', 'no reason given')}")


def chunk_logprobs(meta: dict[str, Any], sent: int) -> dict[str, Any]:
    """A chunk's meta with only the output logprob entries after the first `sent`, and the
    running count under LENGTH_KEY. Takes both of SGLang's stream shapes: per-chunk lists with
    that count (the Engine's) and cumulative lists (a server's), telling them apart by the count."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return meta
    n = len(entries)
    end = int(meta[LENGTH_KEY]) if LENGTH_KEY in meta else min(n, int(meta.get("completion_tokens", n)))
    first = end - n if LENGTH_KEY in meta else 0  # the output position of entries[0]
    lo, hi = max(0, sent - first), end - first
    out = dict(meta)
    for key in _OUT_LOGPROBS:
        if meta.get(key) is not None:
            out[key] = list(meta[key][lo:hi])
    out[LENGTH_KEY] = max(end, sent)
    return out


def _with_text(rows: list[list[Any]], codec: TokenCodec) -> list[list[Any]]:
    """Each (logprob, token_id, _) entry with its token's text, as SGLang's select reports them."""
    texts = iter(codec.decode_each([e[1] for row in rows for e in row]))
    return [[(e[0], e[1], next(texts)) for e in row] for row in rows]


class StreamedLogprobs:
    """Joins per-chunk metas back into one meta with the whole output logprob lists."""

    def __init__(self) -> None:
        self.lists: dict[str, list[Any]] = {key: [] for key in _OUT_LOGPROBS}

    def add(self, meta: dict[str, Any]) -> dict[str, Any]:
        merged = dict(meta)
        for key in _OUT_LOGPROBS:
            if meta.get(key) is not None:
                self.lists[key].extend(meta[key])
                merged[key] = list(self.lists[key])
        return merged


@dataclass
class GenOutput:
    """One generation (or, when streaming, one delta of it)."""

    text: str
    ids: list[int] | None
    meta: dict[str, Any]


class ProgramBackend:
    """What a program runs on. Token backends set `tokenizer`; text-only backends leave it None."""

    tokenizer: Any = None
    supports_pin = False  # pin_prefix really locks KV (in-process engine only)

    _codec: TokenCodec | None = None
    _template: ChatTemplate | None = None

    @property
    def codec(self) -> TokenCodec | None:
        if self._codec is None and self.tokenizer is not None:
            self._codec = TokenCodec(self.tokenizer)
        return self._codec

    def get_chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_tokenizer(self.tokenizer)
        return self._template

    def generate(self, ex: ProgramView, sampling: dict[str, Any], logprob: dict[str, Any]) -> GenOutput:
        raise NotImplementedError

    def generate_stream(
        self, ex: ProgramView, sampling: dict[str, Any], logprob: dict[str, Any]
    ) -> Iterator[GenOutput]:
        """Default: one chunk holding the whole generation."""
        yield self.generate(ex, sampling, logprob)

    def select(
        self, ex: ProgramView, choices: list[str], temperature: float, method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        raise NotImplementedError

    def cache_prefix(self, prefix: str | list[int]) -> None:
        """Best effort: make `prefix` (token ids, or text as a program's first text tokenizes)
        cached on the server (no-op where that means nothing)."""

    def get_tokenizer(self) -> Any:
        """The tokenizer programs on this backend are tokenized with (SGLang's Runtime method)."""
        return self.tokenizer

    def pin_prefix(self, ids: list[int]) -> Any | None:
        return None

    def unpin_prefix(self, handle: Any) -> None:
        return None

    def lanes_opened(self, n: int) -> None:
        """run_batch runs programs on n more concurrent lanes (a hint for batching their calls)."""

    def lane_closed(self) -> None:
        """One of those lanes has no program left to run."""

    def flush_cache(self, empty_cache: bool = True) -> bool:
        return False

    def shutdown(self) -> None:
        return None


class TokenBackend(ProgramBackend):
    """Backends whose requests are token ids. Subclasses implement `_request` (batch,
    blocking, engine-shaped result dicts), `_request_stream` (one prompt, delta chunks), both
    under the request ids they are given, and `abort` (best effort, never raises)."""

    def _request(
        self,
        input_ids: list[list[int]],
        sampling: dict[str, Any],
        rid: list[str] | None = None,
        **logprob: Any,
    ) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _request_stream(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str | None = None, **logprob: Any
    ) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def abort(self, rids: list[str]) -> None:
        """Abort these requests if they still run (a cancelled program run, an interrupt)."""

    def _tracked(self, cancel: RunCancel | None, rids: list[str]) -> AbstractContextManager[None]:
        return cancel.tracking(rids, self.abort) if cancel is not None else nullcontext()

    def _run_tracked(
        self, cancel: RunCancel | None, input_ids: list[list[int]], sampling: dict[str, Any], **logprob: Any
    ) -> list[dict[str, Any]]:
        rids = [uuid.uuid4().hex for _ in input_ids]
        with self._tracked(cancel, rids):
            try:
                return self._request(input_ids, sampling, rid=rids, **logprob)
            except BaseException:
                self.abort(rids)  # e.g. Ctrl-C while waiting: the requests must not run on
                raise

    def generate(self, ex: ProgramView, sampling: dict[str, Any], logprob: dict[str, Any]) -> GenOutput:
        out = self._run_tracked(ex.cancel, [list(ex.ids_)], sampling, **logprob)[0]
        raise_if_aborted(out["meta_info"])
        return GenOutput(out["text"], list(out["output_ids"]), chunk_logprobs(out["meta_info"], 0))

    def generate_stream(
        self, ex: ProgramView, sampling: dict[str, Any], logprob: dict[str, Any]
    ) -> Iterator[GenOutput]:
        sent, rid = 0, uuid.uuid4().hex
        with self._tracked(ex.cancel, [rid]):
            for chunk in self._request_stream(list(ex.ids_), sampling, rid=rid, **logprob):
                raise_if_aborted(chunk["meta_info"])
                meta = chunk_logprobs(chunk["meta_info"], sent)
                sent = int(meta.get(LENGTH_KEY, sent))
                yield GenOutput(chunk["text"], list(chunk["output_ids"]), meta)

    def cache_prefix(self, prefix: str | list[int]) -> None:
        if isinstance(prefix, str):
            codec = self.codec
            if codec is None:
                raise ValueError("cache_prefix(text) needs a backend with a tokenizer")
            prefix = codec.encode(prefix)
        if prefix:
            self._request([list(prefix)], {"max_new_tokens": 0})

    def score(self, prompts: list[list[int]], start: int, cancel: RunCancel | None = None) -> list[list[Any]]:
        """Prompt-token logprobs of each prompt from position `start` (one batched call)."""
        outs = self._run_tracked(
            cancel, prompts, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start
        )
        result = []
        for prompt, out in zip(prompts, outs, strict=True):
            entries = [tuple(e) for e in out["meta_info"]["input_token_logprobs"]]
            expect = prompt[start:]
            if [e[1] for e in entries] != expect:
                raise RuntimeError(
                    f"backend scored tokens {[e[1] for e in entries][:8]} but the choice is {expect[:8]}"
                )
            result.append(entries)
        return result

    def select(
        self, ex: ProgramView, choices: list[str], temperature: float, method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        prefix = list(ex.ids_)
        if not prefix:
            raise ValueError("select needs some text before it to condition on")
        codec = ex.codec
        assert codec is not None
        start, prompts = select_prompts(codec, prefix, choices)
        if len(choices) > 1:  # prefill the shared context once, then score all choices
            self.cache_prefix(prefix[:start])
        cond = _with_text(self.score(prompts, start, ex.cancel), codec)
        uncond = (
            _with_text(self.score([p[start:] for p in prompts], 0, ex.cancel), codec)
            if needs_unconditional(method)
            else None
        )
        return call_method(method, choices, cond, uncond)
