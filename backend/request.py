"""Req: one generation request's whole state as the scheduler sees it — its tokens, where its
KV lives, its sampling state (penalty counts, RNG, grammar), stop checks and the sink its
outputs stream to. The scheduler owns Req objects; nothing else mutates them."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .prefix_cache import CacheHandle
from .sampling_params import SamplingParams
from .stop_regex import StopRegexScan, StopRegexTimeout
from .tokenizer import IncrementalDetokenizer

# What a request sends its caller: {"text", "output_ids", "meta_info"} (JSON-shaped, the wire format).
OutputSink = Callable[[dict[str, Any]], None]
GRAMMAR_DEAD_END = "grammar dead end: no token continues a document its grammar and value checks allow"
# {"type": "stop" | "length" | "abort", then "matched" (a token or stop string), "length" or "message"}
FinishReason = dict[str, str | int]
LogprobEntry = tuple[float | None, int, str | None]  # (logprob, token id, token text: filled by the caller)
TopLogprobs = list[LogprobEntry] | None  # one position's top-k (None where there is none)


class RequestGrammar(Protocol):
    """A constrained request's grammar state as the scheduler uses it (backend/constrained.py)."""

    jump_forward: bool
    dead_end: bool  # the matcher refused a sampled token: nothing valid can follow
    error: str | None  # the matcher raised: the request ends with this message

    def accept_and_jump(self, req: Req, tok: int, stats: object) -> list[int]:
        """Accept tok; returns the ids this step appended (tok, then any forced tokens)."""
        ...

    def is_terminated(self) -> bool: ...


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    detok: IncrementalDetokenizer
    eos_token_ids: frozenset[int] = frozenset()
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    pin_handle: int | None = None  # prefill-only request whose cached prefix stays locked (pin_prefix)

    output_ids: list[int] = field(default_factory=list)
    # KV placement: row in req_to_token; the first prefix_len tokens' slots belong to the prefix
    # cache (locked through cache_handle, prefix_len == its cached_len), the rest up to kv_len are
    # the request's own.
    req_pool_idx: int | None = None
    prefix_len: int = 0
    kv_len: int = 0
    cache_handle: CacheHandle | None = None
    cached_tokens: int = 0
    admitted_once: bool = False
    num_retractions: int = 0
    prompt_key: tuple[int, int] | None = None  # (n, hash of input_ids[:n]): cascade grouping's filter

    finished_reason: FinishReason | None = None
    rng: random.Random | None = None  # a seeded request's own sampling RNG
    penalty_counts: torch.Tensor | None = None  # [V] float: output-token counts
    penalty_seen: torch.Tensor | None = None  # [V] bool: tokens in prompt or output
    grammar: RequestGrammar | None = None  # set when constrained
    stream_sent: int = 0  # chars of text already streamed
    ids_sent: int = 0  # output ids already streamed
    logprobs_sent: int = 0  # output logprob entries already streamed
    created: float = field(default_factory=time.perf_counter)
    e2e_latency: float | None = None  # seconds from creation to the finish, set when it finishes
    stop_cut: int = -1  # where a matched stop string or stop regex starts in detok.text
    stop_checked: int = 0  # chars of detok.text already searched for stop strings
    stop_regex_scan: StopRegexScan | None = None  # set from params.stop_regex

    input_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_token_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprobs_done: bool = False

    def __post_init__(self) -> None:
        if self.params.stop_regex:
            self.stop_regex_scan = StopRegexScan(self.params.stop_regex)

    @property
    def stops_on_text(self) -> bool:
        """Whether its output text is searched after every token (stop strings, stop regexes)."""
        return bool(self.params.stop or self.params.stop_regex)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and not self.input_logprobs_done and self.logprob_start_len >= 0

    @property
    def needs_fresh_state(self) -> bool:
        """Its next sampling reads state that the previous token changes (grammar, penalty counts,
        the min_new_tokens EOS mask): its step samples only after the previous step is processed."""
        return self.grammar is not None or self.penalty_counts is not None or self.params.min_new_tokens > 0

    @property
    def rewrites_on_accept(self) -> bool:
        """Accepting its next token may append forced tokens or replace the token (jump-forward),
        so it cannot be scheduled while that token is in flight."""
        return self.grammar is not None and self.grammar.jump_forward

    def max_prefix_len(self) -> int:
        """How much of the prompt may come from the cache: prompt logprobs need logits from
        logprob_start_len - 1 on, and the last token must always be computed."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)

    def stop_tokens(self) -> set[int]:
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids |= self.eos_token_ids
        return ids

    def check_finished(self, token: int, context_len: int) -> None:
        """After appending one output token: stop token, length, stop string or regex, context end.
        A stop string counts only where it ends past the first min_new_tokens tokens' text, a stop
        regex only where its match starts past it."""
        p = self.params
        n_out = len(self.output_ids)
        grammar = self.grammar
        by_token = False  # ended by this token: a stop token, or the grammar's end
        if grammar is not None and (grammar.dead_end or grammar.error is not None):
            self.finished_reason = {"type": "abort", "message": grammar.error or GRAMMAR_DEAD_END}
        elif n_out >= p.min_new_tokens and token in self.stop_tokens():
            self.finished_reason, by_token = {"type": "stop", "matched": token}, True
        elif n_out >= p.max_new_tokens:
            self.finished_reason = {"type": "length", "length": p.max_new_tokens}
        elif self.seq_len >= context_len:
            self.finished_reason = {"type": "length", "length": n_out}
        elif grammar is not None and grammar.is_terminated():
            self.finished_reason, by_token = {"type": "stop", "matched": token}, True
        # a grammar request ended by this token (its EOS, or the grammar's own end): a stop string
        # inside the text that completed the grammar (forced text included) still cuts
        if self.stops_on_text and (not self.finished or (grammar is not None and by_token)):
            if n_out >= p.min_new_tokens:
                self._check_stop_text()
            else:
                self.stop_checked = len(self.detok.text)
                if self.stop_regex_scan is not None:
                    self.stop_regex_scan.skip_to(len(self.detok.text))

    def _check_stop_text(self) -> None:
        # A new stop-string match ends in the text added since the last check: it starts at most
        # len(s) - 1 characters before it.
        text, checked = self.detok.text, self.stop_checked
        self.stop_checked = len(text)
        hits = [(text.find(s, max(0, checked - len(s) + 1)), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if self.stop_regex_scan is not None:
            try:
                hit = self.stop_regex_scan.search(text)
            except StopRegexTimeout as e:
                self.finished_reason = {"type": "abort", "message": str(e)}
                return
            hits += [hit] if hit is not None else []
        if hits:
            self.stop_cut, matched = min(hits)
            self.finished_reason = {"type": "stop", "matched": matched}

    def cut_stop_token(self) -> None:
        """At the finish: a request that ended on a stop token (a stop_token_id or EOS) leaves that
        token's text out of its text, as SGLang does (kept with no_stop_trim); output_ids keep it."""
        reason = self.finished_reason or {}
        token = reason.get("matched")
        if self.params.no_stop_trim or self.stop_cut >= 0 or reason.get("type") != "stop":
            return
        if not isinstance(token, int) or self.output_ids[-1:] != [token] or token not in self.stop_tokens():
            return
        tail, text = self.detok.text_of([token]), self.detok.text
        if tail:
            cut = (
                len(text) - len(tail)
                if text.endswith(tail)
                else len(self.detok.text_of(self.output_ids[:-1]))
            )
            self.stop_cut = min(cut, len(text))

    def final_text(self) -> str:
        text = self.detok.text
        if self.stop_cut >= 0 and not self.params.no_stop_trim:
            return text[: self.stop_cut]
        return text

    def streamable_text(self) -> str:
        """Text that may be streamed now: hold back a tail that could still start a stop string."""
        text = self.detok.text
        if self.finished:
            return self.final_text()
        if self.stops_on_text and not self.params.no_stop_trim:
            end = len(text) - max((len(s) - 1 for s in self.params.stop), default=0)
            if self.stop_regex_scan is not None:
                end = min(end, self.stop_regex_scan.hold_from(len(text)))
            return text[: max(end, self.stream_sent)]
        return text

    def meta_info(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
        }
        spans = getattr(self.grammar, "jump_spans", None) if self.grammar is not None else None
        if spans:  # output positions written by jump-forward (constrained requests only)
            m["jump_forward_spans"] = [list(s) for s in spans]
        if self.e2e_latency is not None:
            m["e2e_latency"] = self.e2e_latency
        if self.finished and self.grammar is not None and hasattr(self.grammar, "report"):
            m.update(self.grammar.report(self))  # dropped keywords; the JSON-schema check of the output
        if self.return_logprob:
            m["input_token_logprobs"] = self.input_token_logprobs
            m["output_token_logprobs"] = self.output_token_logprobs
            if self.top_logprobs_num > 0:
                m["input_top_logprobs"] = self.input_top_logprobs
                m["output_top_logprobs"] = self.output_top_logprobs
        return m
